"""Sharded checkpoints: save on 4 gloo ranks under several layouts, load under others (resharding of
model and optimizer state), integrity errors and fallback, async saves, RNG restore, pre-emption.

Every tensor is filled with a reference value that depends only on its global name (zero in the
vocabulary padding), so "identical full tensors after resharding" is checked slice by slice on every
rank of every target layout. Budget: about 25 s (one 4-rank run, then single-process loads).
"""
import os
import signal
import zlib

import pytest
import torch

from engine.checkpoint import Checkpointer, CheckpointReader, latest_iteration, load_checkpoint, save_checkpoint
from engine.checkpoint import rng as ckpt_rng
from engine.checkpoint.layout import local_tensors
from engine.config import Config, ConfigError
from engine.layout import Layout
from engine.optim import build_optimizer
from engine.parallel.layers import tp_slice
from engine.parallel.topology import ParallelContext, context_for
from engine.pipeline.partition import build_model_chunks
from engine.run.preemption import PreemptionHandler
from harness import run_ranks

VOCAB = 100  # padded to 108, 120 or 144 for tp 1, 2, 4 (multiples of 12 * tp)


def make_config(style: str, tp=1, pp=1, vpp=None, distributed=False) -> Config:
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 64, 4, 16
    m.vocab_size, m.make_vocab_size_divisible_by = VOCAB, 12
    if style == "llama":
        m.num_attention_heads, m.num_query_groups = 8, 4
        m.normalization, m.position_embedding_type, m.swiglu = "RMSNorm", "rope", True
        m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, True
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.virtual_pipeline_model_parallel_size, p.use_distributed_optimizer = vpp, distributed
    return cfg


def reference(name: str, kind: str, full_shape, valid_rows=None) -> torch.Tensor:
    """A value per (global name, kind) that does not depend on the layout (padding rows are zero).

    fp32 master weights are the parameters (a replicated fp32 optimizer keeps no separate copy)."""
    kind = "model" if kind == "master" else kind
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{kind}".encode()))
    rows = valid_rows or full_shape[0]
    out = torch.zeros(full_shape)
    out[:rows] = torch.randn((rows, *full_shape[1:]), generator=g)
    if kind == "model":
        out *= 0.2  # weights of a realistic size keep logits O(1), where fp32 round-off is ~1e-6
    return out.abs() if kind == "exp_avg_sq" else out


def _local_ref(lt, kind, ctx):
    return tp_slice(reference(lt.name, kind, lt.full_shape, lt.valid_rows), lt.tp_axis, ctx)


def build(cfg, ctx):
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    return chunks, build_optimizer(cfg, chunks, ctx)


@torch.no_grad()
def fill(chunks, opt, ctx, scale=1.0):
    """Set every parameter and optimizer tensor this rank holds to its reference slice (times `scale`)."""
    tensors = {lt.local_name: lt for lt in local_tensors(chunks, ctx)}
    for lt in tensors.values():
        lt.param.copy_(_local_ref(lt, "model", ctx) * scale)
    for local_name, entry in opt.state_dict()["params"].items():
        lt = tensors[local_name]
        lo, hi = entry["range"]
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            if kind in entry:
                entry[kind].copy_(_local_ref(lt, kind, ctx).reshape(-1)[lo:hi] * scale)


def mismatches(chunks, opt, ctx, scale=1.0, with_optim=True) -> list:
    """Names whose value differs from the reference; empty when the load reproduced every full tensor."""
    bad = []
    tensors = {lt.local_name: lt for lt in local_tensors(chunks, ctx)}
    for lt in tensors.values():
        if not torch.equal(lt.param.detach(), _local_ref(lt, "model", ctx) * scale):
            bad.append(f"rank {ctx.rank} {lt.name}")
    if not with_optim:
        return bad
    for local_name, entry in opt.state_dict()["params"].items():
        lt = tensors[local_name]
        lo, hi = entry["range"]
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            if kind in entry and not torch.equal(entry[kind], _local_ref(lt, kind, ctx).reshape(-1)[lo:hi] * scale):
                bad.append(f"rank {ctx.rank} {lt.name}/{kind}")
    return bad


# Saved on 4 ranks: (directory name, style, tp, pp, vpp, distributed optimizer).
SAVED_LAYOUTS = [
    ("gpt_tp2_pp2", "gpt", 2, 2, None, False),      # tied embedding across stages, vocab padded for tp 2
    ("llama_tp1_pp2_vpp2_dp2", "llama", 1, 2, 2, True),
    ("llama_tp2_pp1_dp2", "llama", 2, 1, None, True),
]
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _real(cfg, rank, world):
    return context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)


def _sharded_logits(chunks, ctx):
    """Full-vocabulary logits of a tp-only model, gathered over tp."""
    chunks[0].eval()
    with torch.no_grad():
        local = chunks[0](tokens=TOKENS)
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def _four_rank_cases(rank, world, root):
    out = {"problems": []}
    problems = out["problems"]
    # 1. Save under each layout, with extra state; keep the sharded logits of the tp-only model.
    for name, style, tp, pp, vpp, dist_opt in SAVED_LAYOUTS:
        cfg = make_config(style, tp, pp, vpp, dist_opt)
        ctx = _real(cfg, rank, world)
        chunks, opt = build(cfg, ctx)
        fill(chunks, opt, ctx)
        save_checkpoint(os.path.join(root, name), 7, chunks, opt, ctx, cfg, {"consumed_samples": 56, "sampler": [1, 2]})
        if pp == 1:
            out["logits"] = _sharded_logits(chunks, ctx)
        ctx.destroy()

    # 2. Load under other real layouts (collective path): tp2 pp2 -> tp4 pp1 and tp1 pp4.
    for tp, pp in ((4, 1), (1, 4)):
        cfg = make_config("gpt", tp, pp)
        ctx = _real(cfg, rank, world)
        chunks, opt = build(cfg, ctx)
        extra = load_checkpoint(os.path.join(root, "gpt_tp2_pp2"), chunks, opt, ctx, model_cfg=cfg.model)
        if extra.pop("config")["model"]["num_layers"] != 4 or extra.pop("saved_layout") != "tp 2 x pp 2 x dp 1" or \
                extra != {"consumed_samples": 56, "sampler": [1, 2], "iteration": 7}:
            problems.append(f"extra state {extra}")
        problems += [f"tp{tp} pp{pp}: {m}" for m in mismatches(chunks, opt, ctx)]
        ctx.destroy()

    # 3. Same layout: RNG streams come back; async save snapshots the state at call time.
    cfg = make_config("llama", 1, 2, 2, True)
    ctx = _real(cfg, rank, world)
    chunks, opt = build(cfg, ctx)
    fill(chunks, opt, ctx, scale=2.0)
    torch.manual_seed(1000 + rank)
    expected_rng = ckpt_rng.capture(ctx.rng)
    path = os.path.join(root, "async")
    cfg.checkpoint.save, cfg.checkpoint.async_save = path, True
    checkpointer = Checkpointer(cfg, ctx)
    checkpointer.save(3, chunks, opt, {})
    if checkpointer.latest(path) != 3:  # the same answer on every rank, published or not
        problems.append("a save in flight does not count as the latest")
    fill(chunks, opt, ctx, scale=3.0)  # training goes on while the save is written
    torch.rand(10)
    checkpointer.finalize()
    fresh, fresh_opt = build(cfg, ctx)
    load_checkpoint(path, fresh, fresh_opt, ctx)
    problems += [f"async: {m}" for m in mismatches(fresh, fresh_opt, ctx, scale=2.0)]
    if ckpt_rng.capture(ctx.rng) != expected_rng:
        problems.append("rng states not restored")
    ctx.destroy()

    # 4. Damage: a flipped byte names the file on every rank; --ckpt-fallback loads the previous one.
    cfg = make_config("gpt", 2, 2)
    ctx = _real(cfg, rank, world)
    chunks, opt = build(cfg, ctx)
    path = os.path.join(root, "damaged")
    for it, scale in ((1, 1.0), (2, 2.0)):
        fill(chunks, opt, ctx, scale)
        save_checkpoint(path, it, chunks, opt, ctx, cfg, {"consumed_samples": it})
    if rank == 0:
        _flip_byte(os.path.join(path, "iter_0000002", "model_tp01_pp01.safetensors"))
    torch.distributed.barrier()
    try:
        load_checkpoint(path, chunks, opt, ctx)
        problems.append("a flipped byte was not detected")
    except ConfigError as e:
        out["damage_error"] = str(e)
    extra = load_checkpoint(path, chunks, opt, ctx, fallback=True)
    if extra["iteration"] != 1:
        problems.append(f"fallback loaded {extra}")
    problems += [f"fallback: {m}" for m in mismatches(chunks, opt, ctx, scale=1.0)]
    torch.distributed.barrier()  # nobody reads iteration 1 any more
    if rank == 0:
        optim_file = os.path.join(path, "iter_0000001", "optim_tp00_pp00.safetensors")
        os.truncate(optim_file, os.path.getsize(optim_file) - 10)
    torch.distributed.barrier()
    try:
        load_checkpoint(path, chunks, opt, ctx, fallback=True)
        problems.append("a truncated file was not detected")
    except ConfigError as e:
        out["truncated_error"] = str(e)
    extra = load_checkpoint(path, chunks, opt, ctx, fallback=True, load_optim=False)
    if extra["iteration"] != 1:
        problems.append(f"model-only fallback loaded {extra}")
    problems += [f"model only: {m}" for m in mismatches(chunks, opt, ctx, with_optim=False)]
    ctx.destroy()

    # 5. Pre-emption: a signal on one rank stops every rank.
    handler = PreemptionHandler(signals=(signal.SIGTERM,))
    try:
        before = handler.should_stop()
        if rank == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        out["preempt"] = (before, handler.should_stop(), handler.reason)
    finally:
        handler.restore()
    return out


def _flip_byte(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 5)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(_four_rank_cases, 4, root, timeout=240)


def test_four_rank_cases_have_no_problems(saved):
    _, results = saved
    for r, res in enumerate(results):
        assert res["problems"] == [], (r, res["problems"])


def test_save_layout_on_disk(saved):
    root, _ = saved
    path = os.path.join(root, "llama_tp1_pp2_vpp2_dp2")
    assert latest_iteration(path) == 7
    assert open(os.path.join(path, "latest_checkpointed_iteration.txt")).read().strip() == "7"
    names = sorted(os.listdir(os.path.join(path, "iter_0000007")))
    assert names == ["metadata.json", "model_tp00_pp00.safetensors", "model_tp00_pp01.safetensors",
                     "optim_tp00_pp00_dp000.safetensors", "optim_tp00_pp00_dp001.safetensors",
                     "optim_tp00_pp01_dp000.safetensors", "optim_tp00_pp01_dp001.safetensors"]
    meta = CheckpointReader(os.path.join(path, "iter_0000007")).meta
    assert meta.layout.stage_layers == [[[0], [2]], [[1], [3]]]
    assert meta.layout.distributed_optimizer is True
    assert meta.consumed_samples == 56 and meta.iteration == 7
    assert meta.config["model"]["num_layers"] == 4
    assert meta.optimizer.step == 0 and "scale" in meta.optimizer.scaler
    assert len(meta.rng) == 4 and set(meta.rng[0]) >= {"python", "numpy", "torch", "cuda", "tracker"}
    qkv = meta.tensors["layers.2.attention.qkv.weight"]
    assert (qkv.pp_rank, qkv.vpp_chunk, qkv.tp_axis) == (0, 1, 0)
    pieces = meta.optimizer_tensors["layers.2.attention.qkv.weight"].shards[0]
    assert pieces[0].range[0] == 0 and pieces[-1].range[1] == 128 * 64
    assert all(len(rec.sha256) == 64 for rec in meta.files.values())
    gpt = CheckpointReader(os.path.join(root, "gpt_tp2_pp2", "iter_0000007")).meta
    assert "output" not in gpt.tensors, "the tied embedding is stored once"
    assert gpt.tensors["word.weight"].shape == [120, 64] and gpt.tensors["word.weight"].valid_rows == VOCAB
    assert gpt.tensors["final_norm.weight"].shards == ["model_tp00_pp01.safetensors"]


def test_damaged_files_are_named(saved):
    _, results = saved
    assert all("iter_0000002/model_tp01_pp01.safetensors" in r["damage_error"] for r in results)
    assert all("--ckpt-fallback" in r["damage_error"] for r in results)
    assert all("iter_0000001/optim_tp00_pp00.safetensors" in r["truncated_error"] for r in results)
    assert len({r["damage_error"] for r in results}) == 1, "every rank reports the same line"


def test_preemption_signal_on_one_rank_stops_all(saved):
    _, results = saved
    assert [r["preempt"][:2] for r in results] == [(False, True)] * 4
    assert results[2]["preempt"][2] == "signal SIGTERM"
    assert results[0]["preempt"][2] == "another rank was asked to stop"


TARGETS = [  # (tp, pp, vpp, dp, distributed optimizer)
    (1, 1, None, 1, False), (4, 1, None, 2, True), (1, 4, None, 2, True), (2, 2, 2, 2, True), (2, 1, None, 1, False)]


@pytest.mark.parametrize("name,style", [(n, s) for n, s, *_ in SAVED_LAYOUTS])
def test_reshard_to_other_layouts_reproduces_full_tensors(saved, name, style):
    root, _ = saved
    for tp, pp, vpp, dp, dist_opt in TARGETS:
        cfg = make_config(style, tp, pp, vpp, dist_opt)
        for rank in range(tp * pp * dp):
            ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, tp * pp * dp), tp_rank=rank % tp,
                                          dp_rank=(rank // tp) % dp, pp_rank=rank // (tp * dp))
            chunks, opt = build(cfg, ctx)
            extra = load_checkpoint(os.path.join(root, name), chunks, opt, ctx)
            assert extra["iteration"] == 7
            assert mismatches(chunks, opt, ctx) == [], (name, tp, pp, vpp, dp, dist_opt)


def test_missing_or_empty_directories(tmp_path):
    cfg = make_config("gpt")
    ctx = ParallelContext.virtual()
    chunks, opt = build(cfg, ctx)
    with pytest.raises(ConfigError, match="directory not found"):
        load_checkpoint(str(tmp_path / "nope"), chunks, opt, ctx)
    assert load_checkpoint(str(tmp_path), chunks, opt, ctx) is None
    other = make_config("llama")
    save_checkpoint(str(tmp_path / "llama"), 1, *build(other, ctx), ctx, other, {})
    with pytest.raises(ConfigError, match="different model"):
        load_checkpoint(str(tmp_path / "llama"), chunks, opt, ctx)


def test_merged_and_split_models_give_the_sharded_logits(saved, tmp_path):
    import importlib

    from engine.checkpoint import load_merged
    merge_ckpt = importlib.import_module("tools.merge_ckpt")
    root, results = saved
    path = os.path.join(root, "llama_tp2_pp1_dp2")
    assert merge_ckpt.main(["--load", path, "--out", str(tmp_path / "merged")]) == 0
    assert merge_ckpt.main(["--load", path, "--out", str(tmp_path / "split"), "--target-tp", "1", "--target-pp", "1"]) == 0
    cfg = make_config("llama")
    ctx = ParallelContext.virtual()
    for how in ("merged", "split"):
        chunks, opt = build(cfg, ctx)
        if how == "merged":
            load_merged(str(tmp_path / "merged"), chunks, ctx)
        else:
            load_checkpoint(str(tmp_path / "split"), chunks, opt, ctx)
            assert mismatches(chunks, opt, ctx) == []
        chunks[0].eval()
        with torch.no_grad():
            logits = chunks[0](tokens=TOKENS)[..., :VOCAB]
        assert logits.std() > 0.1
        assert (logits - results[0]["logits"]).abs().max().item() < 1e-5, how
    # The tied GPT embedding saved at tp 2 x pp 2 merges into whole tensors with the padding removed.
    assert merge_ckpt.main(["--load", os.path.join(root, "gpt_tp2_pp2"), "--out", str(tmp_path / "gpt")]) == 0
    gpt = make_config("gpt")
    chunks, opt = build(gpt, ctx)
    load_merged(str(tmp_path / "gpt"), chunks, ctx)
    assert mismatches(chunks, opt, ctx, with_optim=False) == []

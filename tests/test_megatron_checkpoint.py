"""Megatron-LM checkpoints in and out (tools/convert_megatron.py, launch/pretrain_gpt.py --load MEGATRON_SAVE).

The oracle is megatron-core 0.16.1 itself, run on the CPU in a process of its own (tests/megatron_oracle.py; two
gloo ranks): it builds tiny GPT-2- and Llama-shaped GPTModels, DeepSeek-shaped ones (multi-latent attention with a
q latent, latent norms, YaRN with both mscales and two MTP modules at tp 2; without a q latent, plain RoPE and
narrow values at tp 1) and an MoE one with grouped experts and an MTP module, saves them as Megatron-LM does
(torch_dist at tp 1 and tp 2, the legacy torch format at tp 1 (both) and tp 2 (Llama), experts over ep 2), trains
the Llama one at tp 2 with its DistributedOptimizer and OptimizerParamScheduler on an indexed dataset and saves
iteration 5 in both of its optimizer layouts (fully_reshardable, and the default bucket layout dp_reshardable),
then continues to iteration 15. Checked here:
- every save converts, and Ternion's logits equal megatron-core's within 1e-5 at tp 1 and at tp 2 x pp 2; each
  MTP module's logits too (on the positions whose token ahead is inside the sample), and its loss is the
  cross-entropy of megatron-core's;
- `--to-megatron` back (at tp 1 and --target-tp 2): megatron-core's dist_checkpointing.load reads it into a fresh
  model (every weight replaced) whose logits (and MTP logits) equal the original's within 1e-5, its args and
  iteration as written; our own MLA export converts in again to the same tensors;
- `launch/pretrain_gpt.py --load MEGATRON_SAVE` (a process that cannot import Megatron) resumes the training at
  tp 1 and its next 10 losses equal megatron-core's own continuation within 1e-5, from the sample index Megatron
  would read next; both optimizer layouts convert to the same Adam moments and masters;
- the grouped experts of an ep 2 save convert in their global order, and megatron-core reads them back in it;
- bad input (a missing or truncated shard, FP8 arguments, MLA scales megatron-core computes otherwise, an MLA
  checkpoint in the legacy format, a missing mp_rank folder, no checkpoint, a taken --out) is one line and exit
  status 2, with nothing written; so is an export of YaRN settings Megatron-LM has no flags for;
- both directions stream: a 259 MB model converts in and out within a few copies of its largest tensor;
- --decoupled-lr: every parameter's LR and weight decay equal those megatron-core's param groups and scheduler give
  it (tests/test_decoupled_lr.py's check, on this process's output).
Budget on two cores: about 80 s (the oracle process, once, 40 s; a 4-rank pool run; one launcher run; the two
streaming conversions, 18 s): `make test` runs the module, `make test-fast` leaves it out.
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.checkpoint.reader import CheckpointReader
from engine.cli import parse_config
from engine.config import Config
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from harness import run_ranks, tp2_pp2_logits_error
from test_decoupled_lr import SHAPES as DECOUPLED_SHAPES
from test_decoupled_lr import check_rates, group_jobs

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE = os.path.join(ROOT, "tests", "megatron_oracle.py")
VOCAB, SEQ, TOL = 250, 32, 1e-5
SAVES = {  # name: (shape, megatron-core's tp, format, iteration)
    "gpt-tp1": ("gpt", 1, "torch_dist", 7), "llama-tp1": ("llama", 1, "torch_dist", 7),
    "gpt-tp2": ("gpt", 2, "torch_dist", 9), "llama-tp2": ("llama", 2, "torch_dist", 9),
    "gpt-legacy-tp1": ("gpt", 1, "torch", 3), "llama-legacy-tp1": ("llama", 1, "torch", 3),
    "llama-legacy-tp2": ("llama", 2, "torch", 3),
    "mla-tp2": ("mla", 2, "torch_dist", 11), "mla-noq-tp1": ("mla-noq", 1, "torch_dist", 7),
}
BACK = {"llama-tp1": 1, "gpt-tp2": 1, "llama-tp2": 2, "mla-tp2": 2, "mla-noq-tp1": 1}  # --to-megatron at this tp
LLAMA_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "2", "--hidden-size", "64",
               "--ffn-hidden-size", "96", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings",
               "64", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--vocab-size", "256"]


def tokens(n=2, seed=1):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def write_corpus(prefix: str) -> str:
    import numpy as np

    from engine.data import IndexedDatasetWriter
    rng = np.random.default_rng(5)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(200):
        writer.add_document(np.append(rng.integers(0, 250, size=int(rng.integers(5, 60))), 255))
    writer.finalize()
    return prefix


class Oracle:
    """The megatron-core process: its first jobs at start, its second once `then` hands them over."""

    def __init__(self, root, jobs: list):
        self.root = root
        spec = {"world": 2, "jobs": jobs, "ready": str(root / "ready"), "next": str(root / "next.json")}
        (root / "spec.json").write_text(json.dumps(spec))
        self.proc = subprocess.Popen([sys.executable, ORACLE, str(root / "spec.json")], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.wait_for(root / "ready")

    def wait_for(self, path, timeout=300.0) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"megatron-core oracle failed:\n{self.proc.communicate()[0][-6000:]}", pytrace=False)
            time.sleep(0.05)

    def then(self, jobs: list) -> None:
        (self.root / "next.tmp").write_text(json.dumps(jobs))
        os.replace(self.root / "next.tmp", self.root / "next.json")
        out, _ = self.proc.communicate(timeout=300)
        assert self.proc.returncode == 0, out[-6000:]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron-core's saves, logits and training; the conversions of them; its reloads of what Ternion writes."""
    from convert_megatron import main
    if importlib.util.find_spec("megatron") is None:
        pytest.fail("megatron-core is not importable; these tests check the conversions against it. Install the dev "
                    "extras: `make deps` (or pip install -e '.[dev]', which pins megatron-core==0.16.1)", pytrace=False)
    root = tmp_path_factory.mktemp("megatron")
    corpus = write_corpus(str(root / "corpus"))
    jobs = [{"op": "save", "shape": shape, "tp": tp, "format": fmt, "iteration": it, "dir": str(root / name),
             "logits": str(root / f"{name}.logits"), "seed": tp, "consumed": 4 * it} for name, (shape, tp, fmt, it)
            in SAVES.items()]
    jobs += [{"op": "save", "shape": "moe", "tp": 1, "ep": 2, "dir": str(root / "moe"), "iteration": 4,
              "experts": str(root / "moe.experts")},
             *group_jobs(root), {"op": "defaults", "out": str(root / "defaults.json")},
             {"op": "train", "shape": "llama", "tp": 2, "iters": 15, "save_at": 5, "data": corpus,
              "losses": str(root / "train.losses"),
              "saves": {"fully_reshardable": str(root / "train-full"), "dp_reshardable": str(root / "train-dp")}}]
    oracle = Oracle(root, jobs)
    for name in list(SAVES) + ["moe", "train-full", "train-dp"]:
        assert main(["--load", str(root / name), "--out", str(root / f"{name}.ternion")]) == 0
    for name, tp in BACK.items():
        assert main(["--to-megatron", "--load", str(root / f"{name}.ternion"), "--out", str(root / f"{name}.back"),
                     "--target-tp", str(tp), "--target-pp", "1"]) == 0
    assert main(["--to-megatron", "--load", str(root / "moe.ternion"), "--out", str(root / "moe.back")]) == 0
    oracle.then([{"op": "load", "shape": SAVES[name][0], "tp": tp, "dir": str(root / f"{name}.back"),
                  "logits": str(root / f"{name}.back.logits")} for name, tp in BACK.items()]
                + [{"op": "load", "shape": "moe", "tp": 1, "ep": 2, "dir": str(root / "moe.back"),
                    "experts": str(root / "moe.back.experts")}])
    return root


@pytest.mark.parametrize("shape", list(DECOUPLED_SHAPES))
def test_decoupled_lr_gives_each_parameter_megatron_cores_lr_and_weight_decay(megatron, shape):
    check_rates(megatron, shape)  # tests/test_decoupled_lr.py: megatron-core's param groups and scheduler


# Megatron-LM flags whose default here is Megatron-LM's (its arguments.py, core_v0.16.1) where megatron-core's
# dataclass says otherwise.
NOT_CORES = {"muon_momentum": (0.9, 0.95),  # arguments.py's --muon-momentum 0.9; OptimizerConfig 0.95
             "min_lr": (0.0, None),  # --min-lr 0.0; OptimizerConfig leaves it to the scheduler's caller
             "cp_comm_type": ("p2p", None),  # --cp-comm-type p2p; TransformerConfig None (p2p)
             "data_parallel_sharding_strategy": (None, "no_shard"),  # None: optim with the distributed optimizer
             # --no-gradient-accumulation-fusion is a store_false switch: on unless given; ModelParallelConfig False
             "gradient_accumulation_fusion": (True, False)}


def test_megatron_named_flags_default_to_megatron_values(megatron):
    """Every config field that is Megatron-LM's flag with its default (engine/config: `megatron` not marked
    otherwise) has megatron-core's default where megatron-core's configs hold that field, but for NOT_CORES."""
    from engine.config.fields import AS_MEGATRON
    from engine.flags import all_fields, default_of
    core = json.load(open(megatron / "defaults.json"))
    shared = {f.name: default_of(f) for _, f in all_fields() if f.metadata["megatron"] is AS_MEGATRON and f.name in core}
    assert {"hidden_dropout", "attention_dropout", "initial_loss_scale", "hysteresis", "adam_beta2"} <= set(shared)
    differ = {name: (ours, core[name]) for name, ours in shared.items()
              if ours != core[name] and str(ours) != str(core[name])}
    assert differ == NOT_CORES


def converted_config(root, name: str) -> Config:
    return parse_config(["--config", str(root / f"{name}.ternion" / "model.yaml"), "--mock-data"])


def ternion_logits(root, name: str) -> torch.Tensor:
    cfg, ctx = converted_config(root, name), ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(str(root / f"{name}.ternion"), [model], None, ctx, model_cfg=cfg.model)
    with torch.no_grad():
        return model.eval()(tokens=tokens())[..., :VOCAB]


@pytest.mark.parametrize("name", list(SAVES))
def test_converted_logits_equal_megatron_core_at_tp1(megatron, name):
    want = torch.load(megatron / f"{name}.logits")
    assert (ternion_logits(megatron, name) - want).abs().max().item() < TOL
    reader = CheckpointReader(str(megatron / f"{name}.ternion" / f"iter_{SAVES[name][3]:07d}"))
    assert reader.iteration == SAVES[name][3] and reader.meta.extra_state["consumed_samples"] == 4 * SAVES[name][3]


def _tp2_pp2(rank, world, cases):
    """Each converted save's logits of tokens() at tp 2 x pp 2 against megatron-core's."""
    return [e for cfg_dict, ckpt, want in cases
            for e in tp2_pp2_logits_error(rank, world, Config.from_dict(cfg_dict), ckpt, tokens(), want, VOCAB)]


def test_converted_logits_equal_megatron_core_at_tp2_pp2(megatron):
    cases = [(converted_config(megatron, name).to_dict(), str(megatron / f"{name}.ternion"),
              torch.load(megatron / f"{name}.logits")) for name in SAVES]
    errors = [e for rank_errors in run_ranks(_tp2_pp2, 4, cases) for e in rank_errors]
    assert len(errors) == 2 * len(SAVES) and max(errors) < TOL, errors


def _mtp_depths(root, name: str) -> int:
    return converted_config(root, name).model.mtp_num_layers or 0


@pytest.mark.parametrize("name", ["mla-tp2", "mla-tp2-back"])
def test_mtp_modules_predict_as_megatron_cores(megatron, name):
    """Module k's logits at the positions whose input token (k ahead) is inside the sample, caught on their way to
    the head while Ternion's own forward computes the MTP losses; each loss is the mean cross-entropy of
    megatron-core's logits against the token k + 1 ahead. `-back`: our export, reloaded by megatron-core."""
    from engine.mtp import targets
    source = name.removesuffix("-back")
    want = torch.load(megatron / f"{source}.logits.mtp")
    if name.endswith("-back"):
        want = torch.load(megatron / f"{source}.back.logits", weights_only=False)["mtp"]
    cfg, ctx = converted_config(megatron, source), ParallelContext.virtual()
    depth = cfg.model.mtp_num_layers
    assert depth == 2 and want.shape[0] == depth
    model = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(str(megatron / f"{source}.ternion"), [model], None, ctx, model_cfg=cfg.model)
    x, caught, head = tokens(), [], model.head
    model.head = lambda h, labels: caught.append(h.detach()) or head(h, labels)
    labels = torch.cat((x[:, 1:], x[:, :1]), dim=1)  # the last position's target lies past the sample: masked
    mask = torch.ones(labels.shape)
    mask[:, -1] = 0
    model.train()(tokens=x, labels=labels, mtp=targets({"tokens": x, "labels": labels, "loss_mask": mask}, depth))
    losses = model.mtp_measured[0]
    for k in range(depth):
        inside = SEQ - 1 - k  # positions whose input token i + k + 1 exists
        with torch.no_grad():
            got = head(caught[k + 1], None)[:, :inside]
        assert got.shape[-1] == want.shape[-1] == 256 and (got - want[k][:, :inside]).abs().max().item() < TOL
        counted = inside - 1  # and whose target, token i + k + 2, too; the softmax over the padded vocabulary
        ce = torch.nn.functional.cross_entropy(want[k][:, :counted].reshape(-1, 256), x[:, k + 2:].reshape(-1))
        assert abs(losses[k].item() - ce.item()) < TOL, (k, losses[k].item(), ce.item())


@pytest.mark.parametrize("name", list(BACK))
def test_megatron_core_reloads_the_export_with_the_same_logits(megatron, name):
    tp = BACK[name]
    got = torch.load(megatron / f"{name}.back.logits", weights_only=False)
    assert (got["logits"] - torch.load(megatron / f"{name}.logits")).abs().max().item() < TOL
    assert got["iteration"] == SAVES[name][3] and got["args"]["consumed_train_samples"] == 4 * SAVES[name][3]
    assert got["args"]["tensor_model_parallel_size"] == tp and got["args"]["padded_vocab_size"] == 256
    assert (got["mtp"] is None) == (not _mtp_depths(megatron, name))
    if got["mtp"] is not None:
        assert (got["mtp"] - torch.load(megatron / f"{name}.logits.mtp")).abs().max().item() < TOL
        assert got["args"]["mtp_num_layers"] == 2 and got["args"]["multi_latent_attention"]


def test_our_mla_export_converts_in_again_to_the_same_tensors(megatron, tmp_path):
    """Both specs' names of the latent and pre-MLP norms are written; reading picks one, and nothing is left over."""
    from convert_megatron import main
    assert main(["--load", str(megatron / "mla-tp2.back"), "--out", str(tmp_path / "again")]) == 0
    first = CheckpointReader(str(megatron / "mla-tp2.ternion" / "iter_0000011"))
    again = CheckpointReader(str(tmp_path / "again" / "iter_0000011"))
    assert set(again.tensors) == set(first.tensors) and "mtp.1.layer.attention.kv_norm.weight" in first.tensors
    assert all(torch.equal(again.full(name), first.full(name)) for name in first.tensors)


def _experts(prefix) -> dict:
    """Global expert id -> (fc1 [h, F1], fc2 [F, h]) from each ep rank's grouped weights."""
    out = {}
    for rank in range(2):
        d = torch.load(f"{prefix}.{rank}")
        w1, w2 = d["weight1"].view(2, 64, -1), d["weight2"].view(2, -1, 64)  # GroupedMLP's own views
        out.update({d["rank"] * 2 + j: (w1[j], w2[j]) for j in range(2)})
    return out


def test_grouped_experts_over_ep2_convert_in_their_global_order(megatron, tmp_path):
    reader = CheckpointReader(str(megatron / "moe.ternion" / "iter_0000004"))
    fc1, fc2 = reader.full("layers.0.mlp.experts.fc1"), reader.full("layers.0.mlp.experts.fc2")
    saved, reloaded = _experts(megatron / "moe.experts"), _experts(megatron / "moe.back.experts")
    assert sorted(saved) == [0, 1, 2, 3] and not torch.equal(saved[0][0], saved[1][0])
    for e, (w1, w2) in saved.items():
        assert torch.equal(fc1[e], w1) and torch.equal(fc2[e], w2)
        assert torch.equal(reloaded[e][0], w1) and torch.equal(reloaded[e][1], w2)
    from convert_megatron import main
    assert main(["--load", str(megatron / "moe.back"), "--out", str(tmp_path / "again")]) == 0  # our own export, in
    again = CheckpointReader(str(tmp_path / "again" / "iter_0000004"))
    assert set(again.tensors) == set(reader.tensors)
    assert all(torch.equal(again.full(name), reader.full(name)) for name in reader.tensors)


def test_both_optimizer_layouts_carry_the_same_moments_and_masters(megatron):
    full, buckets = (CheckpointReader(str(megatron / f"{n}.ternion" / "iter_0000005")) for n in ("train-full",
                                                                                                   "train-dp"))
    assert full.meta.optimizer.step == buckets.meta.optimizer.step == 5
    assert set(full.meta.optimizer_tensors) == set(buckets.meta.optimizer_tensors) == set(full.tensors)
    for name, entry in full.meta.optimizer_tensors.items():
        shape = tuple(entry.shape)
        assert entry.keys == ["exp_avg", "exp_avg_sq", "master"]
        for key in entry.keys:
            a, b = (r.optimizer_slice(name, key, shape, 1, 0) for r in (full, buckets))
            assert torch.equal(a, b), (name, key)
        assert torch.equal(full.optimizer_slice(name, "master", shape, 1, 0), full.full(name))  # fp32: master = weight
        assert full.optimizer_slice(name, "exp_avg_sq", shape, 1, 0).abs().max() > 0


_NO_MEGATRON = ("import runpy, sys; sys.modules['megatron'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_pretrain_gpt_resumes_the_megatron_run_and_continues_its_losses(megatron):
    """--load the Megatron save itself, in a process where `import megatron` fails."""
    run, want = megatron / "run", torch.load(megatron / "train.losses")
    schedule = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "15", "--lr", "1e-3",
                "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.01",
                "--clip-grad", "1.0", "--seed", "1234", "--data-path", str(megatron / "corpus"), "--split", "100,0,0"]
    out = subprocess.run([sys.executable, "-c", _NO_MEGATRON, "launch/pretrain_gpt.py", *LLAMA_FLAGS, *schedule,
                          "--use-distributed-optimizer", "--load", str(megatron / "train-dp"), "--save", str(run),
                          "--log-interval", "100"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"note: --load {megatron / 'train-dp'} is a Megatron-LM torch_dist checkpoint (iteration 5)" in out.stdout
    assert "resumed from" in out.stdout and "at iteration 5 (20 samples consumed)" in out.stdout
    records = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "lm_loss" in r and "split" not in r]
    assert [r["iteration"] for r in records] == list(range(6, 16))
    assert want["consumed"] == 20 and [r["consumed_samples"] for r in records] == list(range(24, 64, 4))
    errors = [abs(r["lm_loss"] - want["losses"][r["iteration"] - 1]) for r in records]
    assert max(errors) < TOL, errors


def _edit_args(folder, file="common.pt", **changes) -> None:
    """Change saved arguments (read as the converter reads them: Megatron's enums become stand-ins, written back as
    their values, so this process need not import Megatron)."""
    from engine.checkpoint.megatron.pickled import Opaque, load_file
    path = os.path.join(folder, file)
    common = load_file(path, "test")
    plain = {k: v.value if isinstance(v, Opaque) else v for k, v in vars(common["args"]).items()}
    common["args"] = argparse.Namespace(**(plain | changes))
    torch.save(common, path)


def _truncate(path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


BAD = {  # name: (the save a copy of which is broken, how, the words the line must hold)
    "missing-shard": ("llama-tp1", lambda d: os.remove(d / "iter_0000007" / "__0_1.distcp"), "__0_1.distcp is missing"),
    "truncated-shard": ("llama-tp1", lambda d: _truncate(d / "iter_0000007" / "__0_0.distcp"),
                        "__0_0.distcp is truncated"),
    "fp8": ("llama-tp1", lambda d: _edit_args(d / "iter_0000007", fp8="hybrid"), "fp8='hybrid'"),
    "mla-scales": ("mla-noq-tp1", lambda d: _edit_args(d / "iter_0000007", rotary_scaling_factor=4.0,
                                                      mscale_all_dim=1.0),
                   "megatron-core's MLA multiplies the rotated channels by 1 and the softmax scale by 1.29"),
    "mla-legacy": ("llama-legacy-tp2", lambda d: _edit_args(d / "iter_0000003" / "mp_rank_00", "model_optim_rng.pt",
                                                            multi_latent_attention=True),
                   "multi-latent attention or multi-token prediction checkpoint in the legacy torch format"),
    "missing-mp-rank": ("llama-legacy-tp2", lambda d: shutil.rmtree(d / "iter_0000003" / "mp_rank_01"),
                        "mp_rank_01/ is missing"),
    "no-checkpoint": ("llama-tp1", lambda d: shutil.rmtree(d / "iter_0000007"), "not a Megatron-LM checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(megatron, tmp_path, capsys, case):
    from convert_megatron import main
    source = tmp_path / "save"
    shutil.copytree(megatron / BAD[case][0], source)
    BAD[case][1](source)
    capsys.readouterr()
    assert main(["--load", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and BAD[case][2] in err, err
    assert not (tmp_path / "out").exists()


def test_taken_out_and_impossible_targets_are_one_line(megatron, tmp_path, capsys):
    from convert_megatron import main
    taken = megatron / "llama-tp1.ternion"
    before = sorted(os.listdir(taken))
    for argv, words in ((["--load", str(megatron / "llama-tp1"), "--out", str(taken)], "already holds a checkpoint"),
                        (["--to-megatron", "--load", str(taken), "--out", str(tmp_path / "x"), "--target-tp", "3",
                          "--target-pp", "1"], "--target-tp 3"),
                        (["--load", str(megatron / "llama-tp1"), "--out", str(tmp_path / "y"), "--target-tp", "2"],
                         "only with --to-megatron")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert sorted(os.listdir(taken)) == before and not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_launcher_finds_a_megatron_save_by_its_files_and_converts_it_once(megatron, tmp_path):
    from engine.checkpoint import files
    from engine.checkpoint.megatron import megatron_format
    from engine.checkpoint.resume import resume_point
    from engine.config import CheckpointConfig, ConfigError
    assert megatron_format(str(megatron / "llama-tp1")) == "torch_dist"
    assert megatron_format(str(megatron / "llama-tp1" / "iter_0000007")) == "torch_dist"
    assert megatron_format(str(megatron / "gpt-legacy-tp1")) == "torch"
    assert megatron_format(str(megatron / "llama-tp1.ternion")) is None and megatron_format(str(tmp_path)) is None
    load, save = str(megatron / "llama-tp1"), str(tmp_path / "run")
    first = resume_point(CheckpointConfig(load=load, save=save), files.read_latest)
    assert first.directory == os.path.join(save, "megatron_import") and first.iteration is None
    assert first.told[0].startswith(f"note: --load {load} is a Megatron-LM torch_dist checkpoint (iteration 7)")
    again = resume_point(CheckpointConfig(load=load, save=save), files.read_latest)
    assert again.directory == first.directory and "converted earlier" in again.told[0]
    with pytest.raises(ConfigError, match="holds a Megatron-LM checkpoint; give this run a --save of its own"):
        resume_point(CheckpointConfig(load=load, save=load), files.read_latest)


@pytest.mark.slow
def test_both_directions_stream_tensor_by_tensor(tmp_path, monkeypatch):
    """A ~270 MB Llama-shaped checkpoint (from a safetensors folder written here, through tools/convert_hf.py) goes
    out to torch_dist and back, each direction in a fresh process: its peak RSS growth, sampled every
    millisecond, stays within a few copies of the largest tensor (the model is eight times that). glibc is told to
    give freed blocks back (its mmap and trim thresholds), so the figure is what the process holds, not what
    the allocator keeps cached: left to itself, glibc keeps freed pieces around, by chance up to 4x more."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    from convert_hf import main as convert_hf

    from engine.checkpoint import files
    from harness import peak_rss_growth
    from test_hf_import import llama_shapes
    hf = tmp_path / "hf"
    hf.mkdir()
    h, ffn, layers, vocab = 1024, 2816, 4, 8000
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": h, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 64,
        "tie_word_embeddings": False}))
    shapes = llama_shapes(h, ffn, layers, vocab)
    files.write_safetensors(str(hf / "model.safetensors"), [(n, torch.float32, s) for n, s in shapes.items()],
                            ((n, torch.randn(s) * 0.02) for n, s in shapes.items()))
    assert convert_hf(["--hf", str(hf), "--out", str(tmp_path / "ternion"), "--seq-length", "64"]) == 0
    shutil.rmtree(hf)
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    largest = 8064 * h * 4  # the output layer, its vocabulary padded to 63 x 128 rows
    paths = [ROOT, os.path.join(ROOT, "tools")]
    out_code, out_peak, err = peak_rss_growth("convert_megatron", ["--to-megatron", "--load", str(tmp_path / "ternion"),
                                                                   "--out", str(tmp_path / "megatron")], paths)
    assert out_code == 0, err
    in_code, in_peak, err = peak_rss_growth("convert_megatron", ["--load", str(tmp_path / "megatron"), "--out",
                                                                 str(tmp_path / "back")], paths)
    assert in_code == 0, err
    print(f"model {total / 2**20:.0f} MB, largest tensor {largest / 2**20:.1f} MB, peak RSS growth: out "
          f"{out_peak / 2**20:.1f} MB, in {in_peak / 2**20:.1f} MB")
    assert total > 8 * largest and max(out_peak, in_peak) < 3.5 * largest, (out_peak, in_peak)
    back = CheckpointReader(str(tmp_path / "back" / "iter_0000000"))
    first = CheckpointReader(str(tmp_path / "ternion" / "iter_0000000"))
    for name in ("output", "layers.3.mlp.fc1.weight", "layers.0.attention.qkv.weight"):
        assert torch.equal(back.full(name), first.full(name))


def test_megatron_optimizer_arguments_become_ternion_flags():
    """--optimizer (dist_muon is Muon sharded), Muon's arguments by their dest names, --decoupled-lr; what has no
    Ternion counterpart (SGD, a weight decay that changes over the run) is one line."""
    from engine.checkpoint.megatron.args import args_from_config, config_from_args
    from engine.config import ConfigError
    from megatron_oracle import SHAPES, megatron_args
    args = megatron_args(SHAPES["llama"], 1, 1, optimizer="dist_muon", muon_momentum=0.95, muon_split_qkv=False,
                         muon_use_nesterov=True, muon_num_ns_steps=4, muon_scale_mode="unit_rms_norm",
                         muon_tp_mode="duplicated", muon_extra_scale_factor=0.2, decoupled_lr=5e-4,
                         decoupled_min_lr=4.5e-5)
    o = config_from_args(args, "SAVE").optim
    assert (o.optimizer, o.muon_momentum, o.muon_no_split_qkv, o.muon_nesterov, o.muon_num_ns_steps) == \
        ("muon", 0.95, True, True, 4)
    assert (o.muon_scale_mode, o.muon_tp_mode, o.muon_extra_scale_factor) == ("unit_rms_norm", "duplicated", 0.2)
    assert (o.decoupled_lr, o.decoupled_min_lr) == (5e-4, 4.5e-5)
    cfg = config_from_args(args, "SAVE")
    back = args_from_config(cfg, 1, 1, {})
    assert (back.optimizer, back.muon_split_qkv, back.muon_use_nesterov, back.decoupled_lr) == ("muon", False, True, 5e-4)
    for extra, line in (({"optimizer": "sgd"}, "SAVE: the run was saved with optimizer='sgd': only Adam(W) and Muon"),
                        ({"weight_decay_incr_style": "linear", "start_weight_decay": 0.0},
                         "SAVE: the run was saved with start_weight_decay=0.0: a weight decay that changes")):
        with pytest.raises(ConfigError) as info:
            config_from_args(megatron_args(SHAPES["llama"], 1, 1, **extra), "SAVE")
        assert str(info.value).startswith(line), str(info.value)


def test_mla_and_mtp_arguments_go_out_and_back_and_what_megatron_cannot_take_is_one_line():
    """configs/deepseek-v3-tiny.yaml's MLA and MTP flags become Megatron-LM arguments and back; YaRN's original
    context (Megatron-LM has no flag: megatron-core keeps 4096) and MLA scales megatron-core computes otherwise are
    refused by the export in one line."""
    from engine.checkpoint.megatron.args import args_from_config, config_from_args
    from engine.config import ConfigError
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "deepseek-v3-tiny.yaml"), "--mock-data",
                        "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"])
    with pytest.raises(ConfigError, match=r"^--to-megatron: YaRN with original_max_position_embeddings=16: "):
        args_from_config(cfg, 1, 1, {})
    cfg.model.original_max_position_embeddings = 4096
    args = args_from_config(cfg, 1, 1, {})
    assert (args.multi_latent_attention, args.q_lora_rank, args.rope_type, args.mtp_num_layers) == (True, 32, None, 1)
    back = config_from_args(argparse.Namespace(**vars(args)), "SAVE").model
    fields = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
              "mtp_num_layers", "mtp_loss_scaling_factor", "norm_epsilon")
    assert [getattr(back, f) for f in fields] == [getattr(cfg.model, f) for f in fields]
    cfg.model.rope_type = "rope"
    with pytest.raises(ConfigError, match=r"^--to-megatron: --rope-type rope --rotary-scaling-factor 4.0 --mscale 1.0 "
                                          r"--mscale-all-dim 1.0: megatron-core's MLA multiplies the rotated channels "
                                          r"by 1 and the softmax scale by 1.29648, Ternion by 1 and 1$"):
        args_from_config(cfg, 1, 1, {})

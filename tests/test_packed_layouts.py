"""Packed documents in whole models (fp32, CPU, gloo): a packed batch under --reset-attention-mask
--reset-position-ids (and --eod-mask-loss's loss mask) gives the same per-token losses and gradients as running
each document alone, on one rank and at tp 2 + SP, pp 2, cp 2 (p2p and all_gather) and dp 2, whose 20-step
curves equal one rank's; MoE routing keys stay the tokens' indices; the runner counts the documents' attention
pairs and a trainer run reports its FLOPs from them. Budget on two cores: about 20 s (one 2-rank pool run of
every layout, one 2-rank torchrun).
"""
import functools

import numpy as np
import pytest
import torch

from engine import flops
from engine.config import Config, ModelConfig
from engine.documents import Packing
from engine.loss import mean_loss
from engine.model import TIED_EMBEDDING, GPTModel
from engine.moe.router import Router
from engine.parallel import context_split, ring_attention
from engine.parallel.topology import ParallelContext, build_context
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from harness import NO_DROPOUT, SGD_LR, full_grad, grad_buffer, run_ranks
from test_packed_documents import EOD, packed_tokens

VOCAB, SEQ, MICRO, MICROBATCHES = 64, 32, 2, 2
PACKING = Packing(EOD, reset_position_ids=True, reset_attention_mask=True)


def model_cfg(style: str, **kw) -> ModelConfig:
    common = dict(num_layers=2, hidden_size=32, seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=16,
                  init_method_std=0.3) | kw  # large enough that attention across documents would move the loss
    if style == "gpt2":  # learned positions, multi-head attention, LayerNorm, tied embeddings
        return ModelConfig(**NO_DROPOUT, num_attention_heads=4, **common)
    return ModelConfig(**NO_DROPOUT, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",  # rope, GQA
                       position_embedding_type="rope", swiglu=True, disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True, **common)


def microbatches(step: int, samples: int) -> list:
    """Three packed global batches, revisited; no loss where the input is EOD (--eod-mask-loss)."""
    t = packed_tokens(samples, SEQ + 1, seed=3000 + step % 3)
    mask = (t[:, :-1] != EOD).float()
    return [{"tokens": t[i:i + MICRO, :-1], "labels": t[i:i + MICRO, 1:], "loss_mask": mask[i:i + MICRO]}
            for i in range(0, samples, MICRO)]


def documents_alone(model, batch) -> tuple:
    """Every document of the batch run by itself: (per-token losses [b, s] put back in place, the masked sum)."""
    out, total = torch.zeros(batch["tokens"].shape), 0.0
    for r, row in enumerate(batch["tokens"].tolist()):
        start = 0
        for end in [i for i, t in enumerate(row) if t == EOD] + [len(row) - 1]:
            if end < start:
                continue
            piece = slice(start, end + 1)
            losses = model(batch["tokens"][r:r + 1, piece], labels=batch["labels"][r:r + 1, piece])[0]
            out[r, piece] = losses.detach()
            total = total + (losses * batch["loss_mask"][r, piece]).sum()
            start = end + 1
    return out, total


def packed(model, batch, ctx=ParallelContext(), packing=PACKING) -> torch.Tensor:
    """Per-token losses of this rank's positions of a packed batch, through the door."""
    mine = context_split.shard_batch(batch, ctx, packing)
    return model(mine["tokens"], labels=mine["labels"], positions=mine["positions"],
                 position_ids=mine["position_ids"], documents=mine["documents"])


CASES = [("gpt2", "local", None, None), ("llama", "local", None, None), ("llama", "sdpa", "selective", None),
         ("gpt2", "sdpa", "full", None), ("llama", "local", None, "3,0")]


@pytest.mark.parametrize("style,backend,recompute,window", CASES)
def test_a_packed_batch_equals_each_document_alone(style, backend, recompute, window):
    cfg = model_cfg(style, attention_backend=backend, recompute_granularity=recompute, window_size=window)
    batch = microbatches(0, 4)[0]
    alone_model, packed_model = (GPTModel(cfg, ParallelContext(), seed=9).train() for _ in range(2))
    want, total = documents_alone(alone_model, batch)
    total.backward()
    got = packed(packed_model, batch)
    (got * batch["loss_mask"]).sum().backward()
    assert (got - want).abs().max().item() < 1e-5
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-5 * q.grad.abs().max().item() + 1e-8, name
    crossing = packed(GPTModel(cfg, ParallelContext(), seed=9), batch, packing=Packing())
    assert (crossing - want).abs().max().item() > 1e-3  # attention across documents would show


def test_moe_routing_keys_are_token_indices_whatever_the_position_ids(monkeypatch):
    """Capacity decides by (expert, weight, sample, position): the position is the token's index in the sample,
    so --reset-position-ids, which restarts the position ids, leaves every capacity decision as it was (with
    RoPE, relative, and the document mask the layers see the same activations either way)."""
    seen, forward = [], Router.forward
    monkeypatch.setattr(Router, "forward", lambda self, x, keys, shape: seen.append(keys) or forward(self, x, keys,
                                                                                                        shape))
    cfg = model_cfg("llama", num_experts=4, moe_router_topk=2, moe_expert_capacity_factor=0.5,
                    moe_token_drop_policy="position")
    model = GPTModel(cfg, ParallelContext(), seed=9)
    batch = microbatches(1, 2)[0]
    losses = {}
    for name, packing in (("reset", PACKING), ("kept", Packing(EOD, reset_attention_mask=True))):
        losses[name] = packed(model, batch, packing=packing)
    assert not torch.equal(*(context_split.shard_batch(batch, ParallelContext(), p)["position_ids"]
                             for p in (PACKING, Packing(EOD, reset_attention_mask=True))))
    index_keys = torch.stack((torch.arange(2).repeat(SEQ), torch.arange(SEQ).repeat_interleave(2)), dim=1)
    assert len(seen) == 4 and all(torch.equal(k, index_keys) for k in seen)
    assert (losses["reset"] - losses["kept"]).abs().max().item() < 1e-5


# ---------------------------------------------------------------- layouts against one rank

LAYOUTS = [  # (name, model, tp, cp, pp, comm type): two ranks each
    ("tp2-sp", "gpt2", 2, 1, 1, "p2p"),
    ("pp2", "gpt2", 1, 1, 2, "p2p"),
    ("cp2-p2p", "llama", 1, 2, 1, "p2p"),
    ("cp2-all_gather", "gpt2", 1, 2, 1, "all_gather"),
    ("dp2", "llama", 1, 1, 1, "p2p"),
]
STEPS = 20


def lengths_of(row: list, eod: int = EOD) -> list:
    """The document lengths of one sample's tokens, counted here: each EOD ends one, the sample's end the last."""
    ends = [i for i, t in enumerate(row[:-1]) if t == eod]
    return np.diff([-1] + ends + [len(row) - 1]).tolist()


def counted_pairs(model: ModelConfig, batches: list) -> int:
    """The attention pairs the FLOP count gives the batches' documents (sum of L^2 over the model's layers)."""
    return sum(model.num_layers * sum(n * n for n in lengths_of(row)) for batch in batches
               for row in batch["tokens"].tolist())


def _layout(rank, world, style, tp, cp, pp, comm_type):
    """This layout's curve, step-0 gradients (whole, by name), step-0 per-token losses of its positions (pp 1)
    and its runner's attention pairs against the count from the tokens."""
    cfg = Config()
    cfg.model, cfg.training.seed = model_cfg(style), 9
    ctx = build_context(world, rank, tp, pp, sequence_parallel=tp > 1, seed=9, cp=cp, cp_comm_type=comm_type)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, MICRO, 32), torch.float32, "cpu", packing=PACKING)
    grads, curve, first, pairs_ok = grad_buffer(chunks, ctx, MICROBATCHES), [], {}, True
    mine = lambda step: microbatches(step, MICROBATCHES * MICRO * ctx.dp_size)[  # noqa: E731
        ctx.dp_rank * MICROBATCHES:(ctx.dp_rank + 1) * MICROBATCHES]
    with torch.no_grad(), ring_attention.counting() as computed:
        per_token = packed(chunks[0], mine(0)[0], ctx) if pp == 1 else None
    for step in range(STEPS):
        grads.start_step(MICROBATCHES)
        curve.append(runner.run(mine(step)))
        pairs_ok &= runner.attention_pairs == counted_pairs(cfg.model, mine(step))
        grads.finish()
        if step == 0:
            first = {n: full_grad(p, ctx).clone() for c in chunks for n, p in c.named_parameters()}
        with torch.no_grad():
            for p in (p for c in chunks for p in c.parameters()):
                p -= SGD_LR * p.main_grad
    positions = context_split.positions(SEQ, cp, ctx.cp_rank)
    ctx.destroy()
    return curve, first, per_token, positions, pairs_ok, computed.forward


def _every_layout(rank, world):
    return {name: _layout(rank, world, *args) for name, *args in LAYOUTS}


@functools.lru_cache(maxsize=None)
def one_rank(style: str, samples: int) -> tuple:
    """The same training on one rank, through the same door: curve, step-0 gradients and per-token losses."""
    model = GPTModel(model_cfg(style), ParallelContext(), seed=9)
    runner = PipelineRunner([model], ParallelContext(), (SEQ, MICRO, 32), torch.float32, "cpu", packing=PACKING)
    curve, first = [], {}
    with torch.no_grad():
        per_token = packed(model, microbatches(0, samples)[0])
    for step in range(STEPS):
        model.zero_grad()
        curve.append(runner.run(microbatches(step, samples)))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= SGD_LR * p.grad
    return curve, first, per_token


@pytest.mark.slow
def test_layouts_equal_one_rank_per_token_gradients_and_20_step_curve():
    results = run_ranks(_every_layout, 2, timeout=300)
    problems = []
    for name, style, tp, cp, pp, _ in LAYOUTS:
        dp = 2 // (tp * cp * pp)
        ref_curve, ref_grads, ref_tokens = one_rank(style, MICROBATCHES * MICRO * dp)
        for rank, res in enumerate(results):
            curve, grads, per_token, positions, pairs_ok, _ = res[name]
            if not pairs_ok:
                problems.append(f"{name} rank {rank}: the runner's attention pairs differ from the documents'")
            if abs(curve[0] - ref_curve[0]) > 1e-5 or max(abs(a - b) for a, b in zip(curve, ref_curve)) > 1e-4:
                problems.append(f"{name} rank {rank}: curve {curve[:3]}... vs {ref_curve[:3]}...")
            if per_token is not None:
                want = ref_tokens[:, positions] if dp == 1 else microbatch_tokens(style, rank)
                err = (per_token - want).abs().max().item()
                if err > 1e-5:
                    problems.append(f"{name} rank {rank}: per-token losses differ by {err:.3g}")
            for n, got in grads.items():
                want = ref_grads[TIED_EMBEDDING if n == "output" and style == "gpt2" else n]
                err = (got - want).abs().max().item()
                if err > 1e-5 * want.abs().max().item() + 1e-8:
                    problems.append(f"{name} rank {rank}: grad {n} err {err:.3g}")
    assert not problems, "\n".join(problems)
    assert one_rank("llama", 4)[0][-1] < one_rank("llama", 4)[0][0]  # the loss falls
    # the ring computes the visible pairs of the documents, each once over the CP group: L(L + 1) / 2 each
    triangles = sum(n * (n + 1) // 2 for row in microbatches(0, 4)[0]["tokens"].tolist() for n in lengths_of(row))
    for name in ("cp2-p2p", "cp2-all_gather"):
        assert sum(res[name][5] for res in results) == 4.0 * 4 * 8 * triangles * 2, name  # heads, d, layers


def microbatch_tokens(style: str, dp_rank: int) -> torch.Tensor:
    """One rank's per-token losses of the first microbatch a dp rank holds (dp 2: each its own microbatches)."""
    model = GPTModel(model_cfg(style), ParallelContext(), seed=9)
    with torch.no_grad():
        return packed(model, microbatches(0, MICROBATCHES * MICRO * 2)[dp_rank * MICROBATCHES])


def test_one_rank_per_token_losses_are_the_documents_alone():
    """The layouts' reference is itself the oracle's: its first microbatch, document by document."""
    for style in ("gpt2", "llama"):
        model = GPTModel(model_cfg(style), ParallelContext(), seed=9)
        with torch.no_grad():
            want, _ = documents_alone(model, microbatches(0, 4)[0])
        assert (one_rank(style, 4)[2] - want).abs().max().item() < 1e-5
        assert mean_loss(want, microbatches(0, 4)[0]["loss_mask"]).item() == pytest.approx(
            mean_loss(one_rank(style, 4)[2], microbatches(0, 4)[0]["loss_mask"]).item(), abs=1e-6)


def test_runner_counts_attention_pairs_only_for_packed_documents():
    model = GPTModel(model_cfg("gpt2"), ParallelContext(), seed=9)
    batches, counted = microbatches(0, 4), {}
    for name, packing in (("packed", PACKING), ("positions only", Packing(EOD, True)), ("none", Packing())):
        runner = PipelineRunner([model], ParallelContext(), (SEQ, MICRO, 32), torch.float32, "cpu", packing=packing)
        runner.run(batches)
        counted[name] = runner.attention_pairs
    assert counted == {"packed": counted_pairs(model.cfg, batches), "positions only": None, "none": None}
    assert counted["packed"] < 4 * flops.attention_pairs(model.cfg, [SEQ])  # fewer than the whole squares


# ---------------------------------------------------------------- a training run end to end

@pytest.mark.slow
def test_a_training_run_reads_documents_from_its_data_and_counts_their_flops(tmp_path):
    """dp 2 under torchrun on documents ending in the NullTokenizer's EOD: resolve finds the id, the banner says
    how attention and its FLOPs are counted, and each iteration's TFLOP/s are its global batch's documents'."""
    from test_trainer import TINY, last_train_records, launch, read_records

    from engine.cli import parse_config
    from engine.data import BatchSizeSchedule, IndexedDatasetWriter, build_datasets
    from engine.resolve import resolve
    from engine.stability import SpikeGuard
    rng, prefix = np.random.default_rng(0), str(tmp_path / "docs")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(60):
        writer.add_document(np.append(rng.integers(0, 100, size=int(rng.integers(2, 40))), 100))
    writer.finalize()
    args = [a for a in TINY if a != "--mock-data"] + [
        "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--reset-attention-mask",
        "--reset-position-ids", "--eod-mask-loss", "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--tensorboard-dir", str(tmp_path / "tb")]
    code, output, _ = launch(args, 2)
    assert code == 0, output[-5000:]
    assert "packed documents (ended by the end-of-document token): attention within each document and positions " \
           "restarting with each; TFLOP/s and MFU count attention as the sum of L_i^2" in output
    cfg = resolve(parse_config(args), 2)
    assert cfg.eod_id == 100
    samples = BatchSizeSchedule.from_config(cfg.training).samples_before(3) * SpikeGuard.from_config(
        cfg.stability).data_headroom
    train = build_datasets(cfg, samples, 0, 0, log=lambda line: None)[0]
    records = last_train_records(read_records(str(tmp_path / "tb" / "metrics.jsonl")))
    for it in (1, 2, 3):
        rows = [train[i][:-1].tolist() for i in range(4 * (it - 1), 4 * it)]
        pairs = sum(cfg.model.num_layers * sum(n * n for n in lengths_of(row, 100)) for row in rows)
        want = flops.flops_per_iteration(cfg.model, 4, SEQ, pairs=pairs)
        r = records[it]
        assert r["tflops_per_gpu"] * r["iter_time_s"] * 2 * 1e12 == pytest.approx(want, rel=1e-9)
        assert pairs < 4 * flops.attention_pairs(cfg.model, [SEQ])

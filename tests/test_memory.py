"""Activation memory at the bound (issue 14): what autograd keeps per layer, the lean reference ops, threads.

The measured saved-for-backward bytes come from benchmarks/memory.py (the README's table), for tp 1, tp 2
and tp 2 + SP with no / selective / full recomputation, and the masked path of packed documents at tp 1 and
tp 2 + SP; the expected set is derived tensor by tensor there. Measured must equal expected to within 5% above and never fall below it: below would mean the
expected set lists a tensor that backward does not in fact keep.
"""
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import memory
from kernels import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rows():
    return memory.run("cpu")


def test_every_case_saves_what_the_architecture_needs(rows):
    assert [(r["tp"], r["sp"], r["recompute"]) for r in rows if not r["packed"]] == memory.CASES
    assert [(r["tp"], r["sp"], r["recompute"]) for r in rows if r["packed"]] == memory.PACKED
    for r in rows:
        ratio = r["measured"] / r["expected"]
        assert 0.99 <= ratio <= memory.TARGET, memory.table([r], breakdown=True)


def test_sequence_parallelism_and_recomputation_divide_the_memory_they_promise(rows):
    by = {(r["tp"], r["sp"], r["recompute"]): r["measured"] for r in rows if not r["packed"]}
    cfg = memory.llama_config("none")
    shard = memory.SEQ // 2 * memory.MICRO * cfg.hidden_size * 4  # one [s/tp, b, h] fp32 tensor
    # SP keeps shards of the two norm inputs and the two column-parallel inputs instead of whole tensors.
    assert by[(2, False, "none")] - by[(2, True, "none")] == 4 * shard + 2 * (memory.SEQ // 2 * memory.MICRO * 4)
    # Full recomputation keeps the layer input (and the shared RoPE angles) only.
    angles = memory.SEQ * cfg.head_dim() // 2 * 4
    assert by[(2, True, "full")] == shard + angles
    assert by[(1, False, "full")] == 2 * shard + angles


def test_the_masked_path_of_packed_documents_adds_only_its_mask_and_per_sample_angles(rows):
    """The SDPA path keeps its additive copy of the documents' mask ([b, 1, s, s]) unless selective
    recomputation replays the attention core, and RoPE angles per sample ([s, b, d/2]): nothing else."""
    by = {(r["tp"], r["sp"], r["recompute"], r["packed"]): r["measured"] for r in rows}
    cfg, s, b = memory.llama_config("none"), memory.SEQ, memory.MICRO
    angles = s * cfg.head_dim() // 2 * 4 * (b - 1)  # the per-sample table over the shared one
    for tp, sp in ((1, False), (2, True)):
        assert by[tp, sp, "none", True] - by[tp, sp, "none", False] == angles + b * s * s * 4
        for rc in ("selective", "full"):
            assert by[tp, sp, rc, True] - by[tp, sp, rc, False] == angles


def test_the_sequence_parallel_linear_keeps_the_shard_and_regathers_it_in_backward():
    """gather_linear's gradients equal the unfused gather + linear; single-rank group: see test_mappings for tp 2."""
    from engine.parallel import mappings
    x = torch.randn(4, 2, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mappings._GatherLinear.apply(x, w, b, None)
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    g = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), g)
    rx, rw, rb = torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), g)
    torch.testing.assert_close((dx, dw, db), (rx, rw, rb))


def _saved_by_gather_linear(rank, world):
    """At tp = world: the numel of each tensor _GatherLinear keeps for backward, and whether its input shard is one
    of them; and the input's gradient against the unfused gather + linear."""
    from engine.parallel import mappings
    from engine.parallel.topology import build_context
    ctx = build_context(world, rank, world, 1, sequence_parallel=True)
    try:
        torch.manual_seed(rank)
        x = torch.randn(4, 2, 8, requires_grad=True)
        torch.manual_seed(100)
        w, b = torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = mappings.gather_linear(x, w, b, ctx.tp_group)
        keeps_shard = any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
        dx, = torch.autograd.grad(y, x, torch.ones_like(y))
        rx, = torch.autograd.grad(torch.nn.functional.linear(mappings.gather_from_sp(x, ctx.tp_group), w, b), x,
                                  torch.ones_like(y))
        return sorted(t.numel() for t in saved), keeps_shard, torch.allclose(dx, rx)
    finally:
        ctx.destroy()


def test_at_tp_2_the_sequence_parallel_linear_keeps_only_its_shard():
    """On one rank the gathered input is the shard itself, so only tp 2 can tell them apart: backward keeps the
    [s/2, b, h] shard (64 numbers) and the weight (48), never the gathered [s, b, h] (128)."""
    from harness import run_ranks
    for numels, keeps_shard, same_grad in run_ranks(_saved_by_gather_linear, 2, timeout=120):
        assert numels == [48, 64] and keeps_shard and same_grad, (numels, keeps_shard, same_grad)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "layer_norm_no_bias", "swiglu", "apply_rope"])
def test_written_out_backwards_match_autograd_of_the_formula_in_float64(op):
    torch.manual_seed(0)
    d = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w, b = d(3, 2, 8), d(8), d(8)
    freqs = torch.randn(3, 4, dtype=torch.float64)
    cases = {
        "rms_norm": (lambda x, w: reference.rms_norm(x, w, 1e-5), (x, w)),
        "layer_norm": (lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), (x, w, b)),
        "layer_norm_no_bias": (lambda x, w: reference.layer_norm(x, w, None, 1e-5), (x, w)),
        "swiglu": (reference.swiglu, (d(3, 2, 8), x)),
        "apply_rope": (lambda x: reference.apply_rope(x, freqs), (d(3, 2, 2, 8),)),
    }
    fn, args = cases[op]
    assert torch.autograd.gradcheck(fn, args)


def _banner_threads(env_threads):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads
    args = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "1", "--train-iters", "1",
            "--device", "cpu"]
    proc = subprocess.run([sys.executable, "launch/pretrain_gpt.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("device: cpu"))
    return int(line.split(", ")[1].split()[0])


@pytest.mark.slow
def test_the_launcher_respects_omp_num_threads():
    assert _banner_threads("1") == 1
    # Unset, a single process takes the machine's cores (so the setting above is what made it 1).
    assert _banner_threads(None) == max(1, os.cpu_count() or 1)

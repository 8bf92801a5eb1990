"""Issue 34, one rank: the FP8 linear's three GEMMs equal the emulation oracle (quantize, dequantize, fp32
matmul, written here independently of engine/fp8) bit for bit, for every recipe and format, at shapes that
are and are not multiples of the 128 tile; the CPU GEMM equals torch._scaled_mm bit for bit (tensor scales)
and within fp32 accumulation order (1x128 / 128x128 tiles, summed per K block of row-scaled _scaled_mm);
delayed scaling follows its amax history; the experts scale per token and per expert; the flags.
"""
import contextlib
import math
from unittest import mock

import pytest
import torch

from engine import fp8
from engine.cli import parse_config
from engine.config import ConfigError
from engine.fp8 import gemm
from engine.fp8.experts import Fp8Experts
from engine.fp8.linear import Fp8Linear
from engine.fp8.quantize import E4M3, E5M2, quantize, scale_of
from engine.fp8.scaling import Recipe
from engine.flops import GPU_PRESETS
from engine.layout import Layout
from engine.parallel.layers import make_param
from engine.parallel.topology import ParallelContext
from engine.parallel.weight_grad_store import deferring_weight_grads, weight_grads
from engine.planner.layer_time import FP8_GEMM_SPEEDUP, experts_fp8_speedups, gemm_seconds
from engine.planner.software import Software
from engine.planner.step_time import estimate
from engine.report import fp8_lines
from engine.validation import validate
from harness import run_in_fresh_process

SHAPES = [(37, 200, 130), (256, 128, 384), (5, 17, 3), (130, 300, 129)]  # tokens, in, out

RECIPES = [(fmt, kind) for fmt in ("e4m3", "hybrid") for kind in ("tensorwise", "delayed", "blockwise")]


# ------------------------------------------------------------------ the oracle, independent of engine/fp8
def _oracle_q(x, dtype, tile=None):
    """quantize -> dequantize: one scale 2^-0 * max/amax, or per-tile power-of-two scales."""
    top = torch.finfo(dtype).max
    if tile is None:
        a = x.abs().max()
        s = top / a if a > 0 else torch.tensor(1.0)
        return (x * s).clamp(-top, top).to(dtype).float() * (1 / s)
    out = torch.empty_like(x)
    r, c = tile
    for i in range(0, x.shape[0], r):
        for j in range(0, x.shape[1], c):
            block = x[i:i + r, j:j + c]
            a = block.abs().max()
            s = 2.0 ** math.floor(math.log2(top / a.item())) if a > 0 else 1.0
            out[i:i + r, j:j + c] = (block * s).clamp(-top, top).to(dtype).float() * (1 / s)
    return out


def _oracle(x, w, dy, fmt, blockwise):
    g = E5M2 if fmt == "hybrid" else E4M3
    act, wt = ((1, 128), (128, 128)) if blockwise else (None, None)
    xq, wq, dyq = _oracle_q(x, E4M3, act), _oracle_q(w, E4M3, wt), _oracle_q(dy, g, act)
    # each product with both operands contiguous: a strided operand makes the BLAS sum some shapes in
    # another order (one fp32 ulp), and _scaled_mm's operands are contiguous
    y = xq @ wq.t().contiguous()
    dx = dyq @ wq
    if blockwise:  # the weight gradient contracts over tokens: tiles along them
        a, b = _oracle_q(dy.t().contiguous(), g, act), _oracle_q(x.t().contiguous(), E4M3, act).t().contiguous()
    else:
        a, b = dyq.t().contiguous(), xq
    return y, dx, a @ b


def _linear(recipe, n_out, n_in):
    ctx = ParallelContext()
    w = make_param((n_out, n_in), 0, ctx, ("normal", 0.02))
    with torch.no_grad():
        w.normal_(0, 0.05, generator=torch.Generator().manual_seed(n_out * n_in))
    return w, Fp8Linear(recipe, w, ctx)


@pytest.mark.parametrize("fmt,kind", RECIPES)
def test_linear_equals_the_emulation_oracle_bitwise(fmt, kind):
    for t, k, n in SHAPES:
        g = torch.Generator().manual_seed(t + k + n)
        x = (torch.randn(t, k, generator=g) * 3).requires_grad_()
        dy = torch.randn(t, n, generator=g) * 1e-3
        w, lin = _linear(Recipe(fmt, kind), n, k)
        y = lin(x, w)
        y.backward(dy)
        ry, rdx, rdw = _oracle(x.detach(), w.detach(), dy, fmt, kind == "blockwise")
        for name, got, want in (("y", y, ry), ("dx", x.grad, rdx), ("dw", w.grad, rdw)):
            assert torch.equal(got, want), f"{fmt} {kind} {(t, k, n)} {name}: {(got - want).abs().max()}"


def test_tensor_scaled_gemm_is_scaled_mm_bitwise():
    for t, k, n in SHAPES:
        g = torch.Generator().manual_seed(k)
        a, b = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) * 1e-4
        for da, db in ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)):
            qa, qb = quantize(a, scale_of(a.abs().max(), da), da), quantize(b, scale_of(b.abs().max(), db), db)
            want = torch._scaled_mm(qa.data, qb.data.t(), scale_a=qa.scale_inv, scale_b=qb.scale_inv,
                                    out_dtype=torch.float32)
            assert torch.equal(gemm.mm(qa, qb, torch.float32), want), (t, k, n, da, db)


def test_delayed_scaling_follows_the_history():
    ctx = ParallelContext()
    recipe = Recipe("hybrid", "delayed", history_len=3, algo="max", margin=1)
    layer = torch.nn.Module()
    layer.lin = torch.nn.Linear(1, 1)  # a holder; the real model attaches to its parallel linears
    w, lin = _linear(recipe, 8, 16)
    layer.lin.fp8 = lin
    amaxes = []
    for step in range(4):
        x = torch.randn(4, 16) * (step + 1)
        first = lin.input.steps == 0
        q = lin.quantize("input", x)
        want = scale_of(x.abs().max(), E4M3, 1) if first else scale_of(torch.tensor(max(amaxes[-3:])), E4M3, 1)
        assert torch.equal(q.scale_inv, want.reciprocal()), step
        # a second microbatch's input: the step's amax is the larger (kept in place once the history scales)
        x2 = torch.randn(4, 16) * (4 - step)
        lin.quantize("input", x2)
        amaxes.append(max(x.abs().max().item(), x2.abs().max().item()))
        fp8.finish_step([layer], ctx)
        assert lin.input.steps == step + 1 and lin.input.history[0] == amaxes[-1]
    state = fp8.state_dict([layer])
    assert torch.equal(torch.tensor(state["lin.input"]["history"]), torch.tensor(amaxes[::-1][:3]))


def _pushed_one_at_a_time(history, amax, dtype, recipe):
    """The step end of one scaler as written before it was batched: (history, encode scale)."""
    history = torch.roll(history, 1)
    history[0] = amax
    use = history.max() if recipe.algo == "max" else history[0]
    a = use.float()
    ok = (a > 0) & torch.isfinite(a)
    return history, torch.where(ok, torch.finfo(dtype).max / torch.where(ok, a, 1.0), 1.0) / (2.0 ** recipe.margin)


@pytest.mark.parametrize("algo, margin", [("max", 0), ("most_recent", 1)])
def test_the_step_end_moves_every_history_at_once_as_one_at_a_time(algo, margin):
    """fp8.finish_step pushes every scaler's step amax in a few operations over all of them (one scaler at a time
    was ~10 kernel launches each, ~2,000 a step of a 16-layer model on the H200): the histories and scales are
    those of one at a time bit for bit (formats e4m3 and e5m2, amaxes 0, inf and NaN among them), each decode
    scale their reciprocal, and the number of operations does not grow with the number of linears."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func._schema.name.startswith(("aten::view", "aten::unbind", "aten::select", "aten::slice"))
            return func(*args, **(kwargs or {}))

    ctx, recipe = ParallelContext(), Recipe("hybrid", "delayed", history_len=3, algo=algo, margin=margin)
    g = torch.Generator().manual_seed(3)
    counts = []
    for n in (2, 6):
        chunk, lins = torch.nn.Module(), []
        for i in range(n):
            holder = torch.nn.Linear(1, 1)  # a holder; the real model attaches to its parallel linears
            holder.fp8 = _linear(recipe, 8, 16)[1]
            chunk.add_module(f"lin{i}", holder)
            lins.append(holder.fp8)
        scalers = [getattr(lin, role) for lin in lins for role in fp8.ROLES]
        for step in range(4):
            for i, sc in enumerate(scalers):
                sc.seen = torch.tensor([0.0, float("inf"), float("nan"), 3.0][(i + step) % 4] if (i + step) % 5 == 0
                                       else torch.rand((), generator=g).item() * 10 ** (i % 7 - 3))
            want = [_pushed_one_at_a_time(sc.history, sc.seen, sc.dtype, recipe) for sc in scalers]
            with Ops() as ops:
                fp8.finish_step([chunk], ctx)
            for sc, (history, scale) in zip(scalers, want):
                assert torch.equal(sc.history, history) or torch.equal(sc.history.isnan(), history.isnan())
                assert torch.equal(sc.scale, scale) and torch.equal(sc.scale_inv, scale.reciprocal())
                assert sc.steps == step + 1 and sc.seen.item() == 0.0
        counts.append(ops.n)
    assert counts[0] == counts[1] and counts[0] < 40, counts


def test_experts_scale_per_token_and_per_expert():
    """One expert's rows quantized per row: a token's output does not depend on the other tokens."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(10, 24, generator=g), torch.randn(2, 24, 16, generator=g) * 0.1
    for kind in ("tensorwise", "blockwise"):
        ex = Fp8Experts(Recipe("e4m3", kind))
        xg = x.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y = ex(xg, wg, [6, 4])
        alone = ex(x[7:8], w[1:2], [1])
        assert torch.equal(y[7:8], alone), kind
        rows, whole = ((1, 128), (128, 128)) if kind == "blockwise" else ((1, 24), (24, 16))  # power-of-two scales
        want = torch.cat([_oracle_q(x[:6], E4M3, rows) @ _oracle_q(w[0], E4M3, whole),
                          _oracle_q(x[6:], E4M3, rows) @ _oracle_q(w[1], E4M3, whole)])
        assert torch.equal(y, want), kind
        y.sum().backward()
        assert xg.grad is not None and wg.grad.shape == w.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the FP8 tensor cores need a GPU")
def test_gpu_experts_run_on_fp8_tensor_cores():
    """On CUDA, e4m3 tensorwise experts in bf16: forward and the input gradient go through `_scaled_mm` (two calls
    per expert) and equal the exact product of the same codes (the dequantized path in fp32) within the FP8 tensor
    cores' accumulation: Hopper's FP8 MMA keeps fewer bits in its running sum than fp32 (DeepSeek-V3 report,
    section 3.3.2), which on the H200 of 2026-11-26 put this test's outputs up to 2^-10 from the bf16 path's
    (489 of 64,000 beyond one bf16 rounding) and the dense FP8 linear 1.8e-4 of its largest value from the CPU's;
    the bound is one bf16 rounding of each value plus 1e-3 of the largest. The weight gradient (dequantized
    either way, exact bf16 operands) equals the bf16 dequantized path's to one rounding."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(250, 512, generator=g), torch.randn(4, 512, 256, generator=g) * 0.05  # 61-64 tokens each
    dy = torch.randn(250, 256, generator=g)
    runs, calls = {}, []
    assert gemm._row_scaled_runs(torch.device("cuda", torch.cuda.current_device()))  # this build has the kernel
    for rowwise, dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)):
        # the fp32 run takes the bf16 values: the same amaxes, scales and codes (the cast works in fp32)
        xg = x.to("cuda", torch.bfloat16).to(dtype).requires_grad_()
        wg = w.to("cuda", torch.bfloat16).to(dtype).requires_grad_()
        real = torch._scaled_mm
        with mock.patch.object(gemm, "ROWWISE_ON_CUDA", rowwise), \
                mock.patch.object(torch, "_scaled_mm", lambda *a, **k: (calls.append(rowwise), real(*a, **k))[1]):
            y = Fp8Experts(Recipe("e4m3", "tensorwise"))(xg, wg, [64, 61, 64, 61])
            y.backward(dy.to("cuda", torch.bfloat16).to(dtype))
        runs[rowwise, dtype] = (y.float(), xg.grad.float(), wg.grad.float())
    assert calls.count(True) == 8 and calls.count(False) == 0, calls
    (y, dx, dw), exact, bf16 = runs[True, torch.bfloat16], runs[False, torch.float32], runs[False, torch.bfloat16]
    for name, got, want in (("y", y, exact[0]), ("dx", dx, exact[1])):  # one bf16 rounding + the accumulation's
        torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item(), msg=name)
    torch.testing.assert_close(dw, bf16[2], rtol=2 ** -8, atol=1e-6 * bf16[2].abs().max().item())


def test_fp8_flags():
    cfg = parse_config(["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-amax-history-len", "16",
                        "--fp8-amax-compute-algo", "max", "--fp8-margin", "1"])
    assert Recipe.of(cfg.training) == Recipe("hybrid", "blockwise", 16, "max", 1)
    assert Recipe.of(parse_config([]).training) is None
    for flags, words in ((["--fp8-recipe", "mxfp8"], "Blackwell"), (["--fp8-recipe", "nvfp4"], "Blackwell"),
                         (["--fp8-amax-history-len", "0"], "at least")):
        with pytest.raises(ConfigError, match=words):
            validate(parse_config(["--fp8-format", "e4m3", "--mock-data", *flags]), 1)
    assert parse_config(["--fp8-format", "e4m3", "--fp8-param-gather"]).training.fp8_param_gather  # its checks:
    # tests/test_fp8_param_gather.py


def test_the_planner_prices_fp8_gemms_and_casts():
    """Tensor-scaled recipes run the hidden GEMMs at FP8_GEMM_SPEEDUP x the bf16 rate, less the casts' traffic:
    a 1.3B Llama step is faster, though not by the whole factor; blockwise (dequantized, bf16 rate) only pays
    the casts."""
    gpu = GPU_PRESETS["h100-sxm"]
    assert math.isclose(gemm_seconds(4096, 4096, 4096, gpu, FP8_GEMM_SPEEDUP) * FP8_GEMM_SPEEDUP,
                        gemm_seconds(4096, 4096, 4096, gpu))
    cfg = parse_config(["--config", "configs/llama3-1b.yaml", "--seq-length", "2048",
                        "--max-position-embeddings", "2048"])
    layout = Layout(micro_batch_size=2)
    step = {r: estimate(cfg.model, layout, gpu, 16, 2048, software=Software(fp8=r)).step_time_s
            for r in (None, "tensorwise", "delayed", "blockwise")}
    # delayed scaling writes the codes in one pass, current scaling reads for the amax first; and SwiGLU writes its
    # tensors' codes itself (engine/fp8/mlp.py), not with biases
    assert step["delayed"] < step["tensorwise"] < step[None] / 1.1, step
    assert step[None] / step["delayed"] < FP8_GEMM_SPEEDUP, step
    assert step["blockwise"] > step[None], step
    cfg.model.disable_bias_linear = False
    biased = {r: estimate(cfg.model, layout, gpu, 16, 2048, software=Software(fp8=r)).step_time_s
              for r in ("tensorwise", "delayed")}
    assert biased["tensorwise"] > step["tensorwise"] and biased["delayed"] > step["delayed"], (biased, step)
    # Mixtral: the routed experts' forward runs on FP8 tensor cores (row-wise scales), their input gradient too
    # under e4m3 (hybrid's e5m2 gradients are not taken), their weight gradient never; blockwise none of them.
    moe, layout = parse_config(["--config", "configs/mixtral-8x7b.yaml"]).model, Layout(dp=8, ep=8, micro_batch_size=1)
    steps = {(r, f): estimate(moe, layout, gpu, 64, 4096, software=Software(fp8=r, fp8_format=f)).step_time_s
             for r in (None, "tensorwise", "blockwise") for f in ("e4m3", "hybrid")}
    assert steps[("tensorwise", "e4m3")] < steps[("tensorwise", "hybrid")] < steps[(None, "hybrid")], steps
    assert steps[("blockwise", "e4m3")] == steps[("blockwise", "hybrid")] > steps[(None, "e4m3")], steps
    forward, dgrad, wgrad = experts_fp8_speedups(Software(fp8="delayed", fp8_format="e4m3"))
    assert forward == dgrad == FP8_GEMM_SPEEDUP and wgrad == 1.0
    assert experts_fp8_speedups(Software(fp8="delayed")) == (FP8_GEMM_SPEEDUP, 1.0, 1.0)


def test_the_planner_prices_the_fp8_codes_sequence_parallelism_gathers():
    """Under SP with tensor scaling the column-parallel linears' inputs and the row-parallel ones' output gradients
    are gathered as FP8 codes (engine.fp8.linear): each all-gather moves 1 byte an element and each reduce-scatter 2,
    an all-reduce of 1.5 bytes, forward and backward; runs without SP, without FP8 or blockwise keep the bf16
    volume. Llama 3 70B at tp 8 is faster for it."""
    from engine.planner.layer_time import _tp_comm
    from engine.planner.links import Link, all_reduce
    link, elements = Link(3600, 0.77, 15e-6), 8192 * 8192
    bf16, codes = 2 * all_reduce(2 * elements, 8, link), 2 * all_reduce(1.5 * elements, 8, link)
    assert codes < 0.77 * bf16  # 3/4 of the bytes; the latency stays
    for sp, recipe, want in ((True, "tensorwise", codes), (True, "delayed", codes), (True, "blockwise", bf16),
                             (True, None, bf16), (False, "delayed", bf16)):
        layout = Layout(tp=8, sequence_parallel=sp)
        assert _tp_comm(2, elements, layout, Software(fp8=recipe), link) == want, (sp, recipe)
    model, gpu = parse_config(["--config", "configs/llama3-70b.yaml"]).model, GPU_PRESETS["h100-sxm"]

    def step():
        return estimate(model, Layout(tp=8, pp=4, dp=2, sequence_parallel=True), gpu, 64, 8192,
                        software=Software(fp8="delayed")).step_time_s

    def as_bf16(entries, elements, layout, sw, link):
        return entries * all_reduce(2 * elements, layout.tp, link) * (1 - sw.tp_comm_overlap)

    with mock.patch("engine.planner.layer_time._tp_comm", as_bf16):
        gathering_bf16 = step()
    assert step() < gathering_bf16


def test_the_banner_says_what_runs_in_fp8_and_what_mfu_is_against():
    assert fp8_lines(parse_config([])) == []
    line, = fp8_lines(parse_config(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                    "--fp8-amax-history-len", "16"]))
    for words in ("hybrid", "e5m2 gradients", "delayed", "history of 16", "output layer", "in bf16",
                  "MFU is against the dense bf16 peak"):
        assert words in line, (words, line)


def test_the_banner_memory_estimate_counts_the_fp8_gather():
    """With --fp8-param-gather the banner's estimate adds the codes and payloads the planner counts
    (engine/planner/fp8_gather.py, equal to the engine's in tests/test_planner_sharding.py) and names them; under
    ZeRO-3 each rank's own payloads and the unit gathers' codes and payloads in flight."""
    from engine.planner.fp8_gather import fp8_gather_bytes
    from engine.report import _memory_line, memory_estimate
    cfg = parse_config(["--config", "configs/llama3-1b.yaml", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe",
                        "delayed", "--fp8-param-gather", "--use-distributed-optimizer"])
    ctx = ParallelContext.virtual(layout=Layout(dp=8, sharding_strategy="optim"))
    mem = memory_estimate(cfg, ctx, 64, "flash")
    b = fp8_gather_bytes(cfg.model, ctx.layout, "bf16", 0)
    assert mem.fp8_gather == b.codes + b.payloads > 0
    assert "FP8 gather codes and payloads" in _memory_line(mem, "bf16", True)
    cfg.training.fp8_param_gather = False
    without = memory_estimate(cfg, ctx, 64, "flash")
    # without the flag no codes are gathered, and the weights are held quantized for the step instead (2 bytes an
    # element: tests/test_fp8_output_layer.py); with it the gathered codes stand in for them
    assert without.fp8_gather == 0 == mem.fp8_held and without.fp8_held > 0
    assert mem.allocated - without.allocated == mem.fp8_gather - without.fp8_held
    line = _memory_line(without, "bf16", True)
    assert "FP8 gather" not in line and "FP8 weights held for the step" in line
    cfg.training.fp8_param_gather = True
    zero3 = ParallelContext.virtual(layout=Layout(dp=8, sharding_strategy="optim_grads_params"))
    b3 = fp8_gather_bytes(cfg.model, zero3.layout, "bf16", 0)
    mem3 = memory_estimate(cfg, zero3, 64, "flash")
    assert mem3.fp8_gather == b3.payloads + b3.transient > 0 and b3.codes == 0
    assert "FP8 gather codes and payloads" in _memory_line(mem3, "bf16", True)


def test_a_split_backward_defers_the_fp8_weight_gradient():
    """Under the zero-bubble schedules' split backward the FP8 weight gradient waits for the W pass and is the
    same number."""
    g = torch.Generator().manual_seed(9)
    x, dy = torch.randn(40, 24, generator=g), torch.randn(40, 16, generator=g)
    grads = []
    for split in (False, True):
        w, lin = _linear(Recipe("hybrid", "blockwise"), 16, 24)
        xg = x.clone().requires_grad_()
        store = []
        with deferring_weight_grads(store) if split else contextlib.nullcontext():
            y = lin(xg, w)
        y.backward(dy)
        assert (w.grad is None) == split and len(store) == split
        weight_grads(store)
        grads.append((xg.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("kind, moe", [("tensorwise", True), ("delayed", False), ("blockwise", True)])
def test_a_step_quantizes_each_weight_once_for_all_its_microbatches(kind, moe):
    """engine.fp8.weights_held: over a step of 2 microbatches each FP8 linear casts its weight once and transposes
    it once (in the same pass under tensor scaling: no transpose of the codes apart), and each routed expert's
    weight is cast once, not once a microbatch, and the run (losses, amax histories, final weights) is bit for bit
    the one that quantizes per microbatch."""
    from test_fp8_layouts import MICROBATCHES, VOCAB, _cfg, _run

    from engine.fp8.quantize import Quantized
    from engine.model import GPTModel
    steps, runs = 3, {}
    for hold in (True, False):
        cfg, ctx = _cfg(kind, moe=moe), ParallelContext()
        model = GPTModel(cfg.model, ctx, seed=cfg.training.seed, vocab_size=VOCAB)
        fp8.attach(model, fp8.Recipe.of(cfg.training), ctx)
        keepers = [*fp8.linears([model]).values(), *fp8.experts([model])]
        for k in keepers:
            k.may_hold = hold
        casts, transposes, expert_casts = [], [], []
        cast, transpose, expert_cast = Fp8Linear.quantize, Quantized.t, Fp8Experts.weight
        with mock.patch.object(Fp8Linear, "quantize", lambda self, role, x, transposed=False: (
                casts.append(role), cast(self, role, x, transposed))[1]), \
                mock.patch.object(Quantized, "t", lambda self: (transposes.append(self.transposed is None),
                                                                transpose(self))[1]), \
                mock.patch.object(Fp8Experts, "weight", lambda self, w: (expert_casts.append(1),
                                                                         expert_cast(self, w))[1]):
            run = _run(cfg, [model], ctx, steps=range(steps))
        assert not any(k.holding or k.held for k in keepers)  # nothing outlives the schedule
        runs[hold] = dict(run, weights=[p.detach().clone() for p in model.parameters()],
                          casts=casts.count("weight"), transposes=len(transposes), apart=sum(transposes),
                          expert_casts=len(expert_casts),
                          linears=len(fp8.linears([model])))
    held, each = runs[True], runs[False]
    assert held["linears"] > 0 and held["casts"] == steps * held["linears"]
    assert each["casts"] == MICROBATCHES * held["casts"]
    assert each["transposes"] - held["transposes"] == (MICROBATCHES - 1) * steps * held["linears"]
    # a held W's transpose comes with its codes in one pass (Fp8Linear.both_ways), tiles' apart once a step
    assert held["apart"] == (steps * held["linears"] if kind == "blockwise" else 0)
    assert each["apart"] == MICROBATCHES * steps * held["linears"]
    assert (held["expert_casts"] > 0) == moe and each["expert_casts"] == MICROBATCHES * held["expert_casts"]
    assert held["curve"] == each["curve"] and held["end"] == each["end"]
    assert all(torch.equal(a, b) for a, b in zip(held["weights"], each["weights"]))


_COMPILES_CHECK = """
import torch
from torch._dynamo.testing import CompileCounter
from engine.fp8 import quantize as q
from engine.fp8.experts import Fp8Experts
from engine.fp8.linear import Fp8Linear
from engine.fp8.scaling import Recipe
from engine.parallel.layers import make_param
from engine.parallel.topology import ParallelContext
counters, real = {}, torch.compile
torch.compile = lambda f, **kw: real(f, backend=counters.setdefault(id(f.__code__), CompileCounter()), **kw)
q._fused = lambda x: not torch.compiler.is_compiling()  # CUDA's path, here on the CPU
ctx, parts = ParallelContext(), []
for fmt in ("e4m3", "hybrid"):
    for kind in ("tensorwise", "delayed", "blockwise"):
        r = Recipe(fmt, kind)
        w = make_param((32, 64), 0, ctx, ("normal", 0.02))
        parts.append((Fp8Linear(r, w, ctx), w, Fp8Experts(r), torch.randn(3, 64, 32, requires_grad=True)))
def step(dtype):
    for lin, w, experts, we in parts:
        x = torch.randn(2, 24, 64, dtype=dtype, requires_grad=True)
        lin(x.reshape(48, 64), w.to(dtype)).float().square().sum().backward()  # a view of x, as the layers pass
        xe = torch.randn(40, 64, dtype=dtype, requires_grad=True)
        experts(xe, we.to(dtype), [12, 8, 20]).float().square().sum().backward()
for dtype in (torch.bfloat16, torch.float32):
    step(dtype)
first = [c.frame_count for c in counters.values()]
step(torch.bfloat16), step(torch.float32)
limit = torch._dynamo.config.recompile_limit
assert [c.frame_count for c in counters.values()] == first, "a later step compiled again"
assert len(first) >= 3 and max(first) < limit, (first, limit)
print("compiled", first)
"""


@pytest.mark.slow  # a fresh process and every recipe traced twice: ~6 s
def test_the_fused_casts_stay_compiled_for_every_operand_kind():
    """On CUDA each amax and cast is a compiled function; dynamo keeps at most recompile_limit (8) versions of one
    and then runs it eagerly without an error (the H200 run of 2026-11-26: 9 operand kinds through one function,
    the FP8 step at 0.45x bf16's). Every operand kind a step makes (formats, recipes, linears and experts, bf16 and
    fp32, views, transposes, autograd flags) stays under that limit and a second step compiles nothing new.
    Traced here with a counting backend (no inductor), in a process of its own as below."""
    run_in_fresh_process(_COMPILES_CHECK, "compiled")


_FUSED_CAST_CHECK = """
import torch
from engine.fp8 import quantize as q
g = torch.Generator().manual_seed(0)
for dtype in (q.E4M3, q.E5M2):
    for shape in ((64, 48), (33, 160), (7, 5)):
        x = (torch.randn(shape, generator=g) * 40).to(torch.bfloat16)
        scale = q.scale_of(x.abs().amax(), dtype) * 4  # a quarter of the elements saturate
        fused, ops = q._fused_cast(dtype, scale.dim())(x, scale, dtype), q._cast_ops(x, scale, dtype)
        assert torch.equal(fused.view(torch.uint8), ops.view(torch.uint8)), (dtype, shape)
        assert torch.equal(q._fused_amax()(x), q._amax_ops(x)), shape
print("bitwise")
"""


@pytest.mark.slow
def test_the_fused_cast_is_the_eager_cast_bit_for_bit():
    """What CUDA runs (quantize._fused_cast and _fused_amax: inductor's kernels) rounds and saturates exactly as the eager ops
    (checked here with inductor's CPU code, at shapes that are no multiple of anything, values beyond the range).
    In a process of its own: inductor's import of triton would leave the interpreter the kernel tests use broken."""
    run_in_fresh_process(_FUSED_CAST_CHECK, "bitwise")


def _mlp_pair(recipe, dtype):
    """Two FP8 SwiGLU MLPs (hidden 40, ffn 72) with one set of weights: the fused one (engine.fp8.mlp) and the
    three apart."""
    from tiny_llama import tiny_llama

    from engine.model import MLP
    cfg = tiny_llama(1, 8, 64).model
    cfg.hidden_size, cfg.ffn_hidden_size = 40, 72
    ctx, pair = ParallelContext(), []
    for fused in (True, False):
        mlp = MLP(cfg, ctx, 0.02, "cpu", dtype)
        with torch.no_grad():
            g = torch.Generator().manual_seed(3)
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        with _one_pass(fused):
            fp8.attach(mlp, recipe, ctx)
        assert (mlp.fp8 is not None) == (fused and not recipe.blockwise)
        pair.append(mlp)
    return pair


def _one_pass(on: bool):
    """engine.fp8.quantize.ONE_PASS_CODES set: off, every cast apart and SwiGLU's tensors made in bf16."""
    from engine.fp8 import quantize as quantization
    return mock.patch.object(quantization, "ONE_PASS_CODES", on)


@pytest.mark.parametrize("kind", ["tensorwise", "delayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_swiglu_mlp_is_its_three_linears_apart_bit_for_bit(kind, dtype):
    """engine.fp8.mlp makes SwiGLU's output and input gradient as FP8 codes inside one function, and the linears
    make their inputs' and gradients' codes with their transpose: the output, input gradient and weight gradients,
    and every scaler's last scales, step amaxes and histories, equal fc1 -> SwiGLU -> fc2 apart with every cast
    apart (quantize.ONE_PASS_CODES off; each linear the emulation oracle's, above) bit for bit, over three steps of
    two microbatches (under delayed scaling the first step scales currently, the later ones from the history)."""
    pair = _mlp_pair(Recipe("hybrid", kind, history_len=2, algo="max"), dtype)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        for _ in range(2):
            x = (torch.randn(6, 3, 40, generator=g) * (1 + step)).to(dtype)
            dy = torch.randn(6, 3, 40, generator=g).to(dtype)
            outs = []
            for mlp, one_pass in zip(pair, (True, False)):
                xi = x.clone().requires_grad_()
                with _one_pass(one_pass):
                    y = mlp(xi)
                    y.backward(dy)
                lins = (mlp.fc1.fp8, mlp.fc2.fp8)
                outs.append([y, xi.grad, *(p.grad for p in mlp.parameters()),
                             *(getattr(lin, r).last for lin in lins for r in fp8.ROLES),
                             *(getattr(lin, r).seen for lin in lins for r in fp8.ROLES)])
            assert len(outs[0]) == len(outs[1]) == 16
            assert all(torch.equal(a, b) for a, b in zip(*outs)), (step, [torch.equal(a, b) for a, b in zip(*outs)])
        for mlp in pair:
            fp8.finish_step([mlp], ParallelContext())
            for p in mlp.parameters():
                p.grad = None
        assert fp8.state_dict([pair[0]]) == fp8.state_dict([pair[1]])
    assert kind != "delayed" or pair[0].fc2.fp8.input.steps == 3


def test_the_fp8_swiglu_mlp_defers_its_weight_gradients_under_a_split_backward():
    """Under zero-bubble's split backward both weights' gradients wait for the W pass and are the same numbers."""
    grads = []
    for split in (False, True):
        mlp = _mlp_pair(Recipe("hybrid", "tensorwise"), torch.float32)[0]
        x = torch.randn(5, 2, 40, generator=torch.Generator().manual_seed(8), requires_grad=True)
        store = []
        with deferring_weight_grads(store) if split else contextlib.nullcontext():
            y = mlp(x)
        y.square().sum().backward()
        assert (mlp.fc1.weight.grad is None) == split and len(store) == 2 * split
        weight_grads(store)
        grads.append((x.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))

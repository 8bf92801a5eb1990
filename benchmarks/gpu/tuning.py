"""Section 3b, launch settings of the bandwidth kernels measured side by side: what the goals table's misses
would be changed to (METHOD: measure the variants in one run, then choose).

First the FP8 codes kernels (kernels/fp8_triton.py) under delayed scaling: a cast's codes (4096 x 2048) and
SwiGLU's (4096 x 8192), bf16, at each block shape and warp count of CODES_LAUNCHES. Then RMSNorm at 16k rows x
8192 (bf16) at the launches of NORM_LAUNCHES: the default the H200 sweep of 2026-11-27 chose (16 warps a row, 8
backward programs per multiprocessor, 2 rows a backward loop iteration), its neighbours, and the earlier default.
(That sweep ran the full grid: warps 4-32 x programs 2-8 at one row, then rows 2 and 4 at the best programs; two
rows at 4 warps spilled.) Then add + RMSNorm and LayerNorm at the launches of NORM_OTHERS. Then RoPE at
[4096, 4, 32, 128]: warps per program (rope_triton.MAX_WARPS) at one row a program, then 2 and 4 (position, sample)
rows a program (ROWS_PER_PROGRAM) at 4 and 8 warps. Each variant: median
of device-event timings, TB/s of the fewest bytes (FP8 codes: 2 bytes in, 2 out an element; SwiGLU's 6; norm
forward 2 passes, backward 3; RoPE 2 each way). The module constants are set for each variant with unittest.mock
and restored after it.
"""
from __future__ import annotations

from unittest import mock

import torch

from benchmarks.gpu.context import NEEDS_CUDA
from benchmarks.kernel_speed import median_ms
from kernels import dispatch

# RMSNorm (warps, backward programs per SM, backward rows an iteration): the default first, the earlier one last
NORM_LAUNCHES = ((16, 8, 2), (16, 8, 1), (8, 8, 2), (32, 8, 2), (16, 4, 2), (4, 2, 1))
# the other norms at the rows a loop iteration the spill rule decides between (ptxas: add + RMSNorm spills 252 bytes
# at 2 rows, LayerNorm 372, neither at 1), and LayerNorm's earlier launch (2,000 bytes spilled)
NORM_OTHERS = (("add_rms_norm", 16, 8, 2), ("add_rms_norm", 16, 8, 1), ("layer_norm", 16, 8, 1),
               ("layer_norm", 16, 8, 2), ("layer_norm", 4, 2, 1))
ROPE_WARPS = (2, 4, 8, 16)
ROPE_ROWS, ROPE_ROWS_WARPS = (2, 4), (4, 8)  # RoPE's rows per program beyond 1, at the two best warp counts so far
# the FP8 codes kernels (fp8_triton): block rows x columns and warps. The first is the launch the H200 of 2026-11-27
# timed (1.64 TB/s for a cast's codes, 4096 x 2048; 2.56 for SwiGLU's, 4096 x 8192), the second today's default
# (fp8_triton.WARPS = 8, chosen by ptxas's register report)
CODES_LAUNCHES = ((64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 128, 8), (32, 128, 4), (128, 128, 8))


def run(opts, record, earlier) -> None:
    if not opts.cuda or not dispatch.triton_available():  # launch settings mean nothing to the interpreter
        record.skip("launch-setting sweep", NEEDS_CUDA)
        return
    dev, cuda = "cuda", True
    reps = opts.pick(20, 10, 2)
    if fp8_codes(opts, record, dev, reps):
        norms_and_rope(opts, record, dev, reps)


def fp8_codes(opts, record, dev, reps) -> bool:
    """The FP8 codes kernels under delayed scaling (the scale known, the amax max-ed into a running one) at each of
    CODES_LAUNCHES: a cast's codes and SwiGLU's, TB/s of their fewest bytes (bf16 in, two FP8 copies out); False
    when time ran out."""
    from kernels import fp8_triton
    g = torch.Generator().manual_seed(5)
    tokens, hidden, ffn = opts.pick((4096, 2048, 8192), (4096, 2048, 8192), (64, 64, 128))
    x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)
    gate, up = torch.randn(tokens, 2 * ffn, generator=g).to(dev, torch.bfloat16).chunk(2, dim=-1)
    scale, into = torch.tensor(30.0, device=dev), torch.zeros((), device=dev)
    cases = (("cast", lambda: fp8_triton.fp8_codes(x, scale, torch.float8_e4m3fn, True, into), 4 * x.numel()),
             ("swiglu forward", lambda: fp8_triton.swiglu_fp8(gate, up, scale, torch.float8_e4m3fn, True, into),
              6 * gate.numel()))
    for rows, cols, warps in CODES_LAUNCHES:
        if not record.has_time(f"fp8 codes {rows}x{cols} warps {warps}", 4.0):
            return False
        with mock.patch.multiple(fp8_triton, BLOCK_ROWS=rows, BLOCK_COLS=cols, WARPS=warps):
            for name, fn, nbytes in cases:
                ms = median_ms(fn, reps, True)
                record.row("tuning", {"kernel": f"fp8 codes: {name}", "warps": warps, "block": f"{rows}x{cols}",
                                      "fwd_ms": ms, "fwd_tbps": nbytes / ms / 1e9},
                           f"fp8 codes {name} block {rows}x{cols} warps {warps}: {nbytes / ms / 1e9:.2f} TB/s")
    return True


def norms_and_rope(opts, record, dev, reps) -> None:
    """The RMSNorm and RoPE sweeps (the module docstring)."""
    from kernels import norm_triton, rope_triton
    cuda, dtype = True, torch.bfloat16
    m, n = opts.pick((16384, 8192), (16384, 8192), (32, 256))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, n, generator=g).to(dev, dtype).requires_grad_(True)
    w = torch.rand(n, generator=g).to(dev, dtype).requires_grad_(True)
    dy = torch.randn(m, n, generator=g).to(dev, dtype)
    size = m * n * x.element_size()

    r = torch.randn(m, n, generator=g).to(dev, dtype).requires_grad_(True)
    b = torch.rand(n, generator=g).to(dev, dtype).requires_grad_(True)
    # (forward, backward inputs, passes over the tensor forward and backward): the residual variant reads and writes
    # the sum too and takes its gradient back
    kinds = {"rms_norm": (lambda: norm_triton.rms_norm(x, w, 1e-5), (x, w), 2, 3),
             "add_rms_norm": (lambda: norm_triton.add_rms_norm(x, r, w, 1e-5), (x, r, w), 4, 4),
             "layer_norm": (lambda: norm_triton.layer_norm(x, w, b, 1e-5), (x, w, b), 2, 3)}

    def norm_variant(kind: str, warps: int, per_sm: int, rows: int) -> dict | None:
        what = f"{kind} warps {warps} programs/SM {per_sm} rows/iter {rows}"
        if not record.has_time(what, 3.0):
            return None
        forward, inputs, fwd_passes, bwd_passes = kinds[kind]
        # the rows asked for, whatever the launcher's rule for a thread's elements would pick
        with mock.patch.multiple(norm_triton, MAX_WARPS=warps, BWD_PROGRAMS_PER_SM=per_sm, BWD_ROWS_PER_ITER=rows,
                                 BWD_MAX_PER_THREAD=1 << 20):
            fwd = median_ms(forward, reps, cuda)
            y = forward()
            outs, grads = (y, (dy,)) if kind != "add_rms_norm" else (y, (dy, dy))
            bwd = median_ms(lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True), reps, cuda)
        row = {"kernel": kind, "warps": warps, "programs_per_sm": per_sm, "rows_per_iter": rows, "fwd_ms": fwd,
               "bwd_ms": bwd, "fwd_tbps": fwd_passes * size / fwd / 1e9, "bwd_tbps": bwd_passes * size / bwd / 1e9,
               "fwd_bwd_tbps": (fwd_passes + bwd_passes) * size / (fwd + bwd) / 1e9}
        record.row("tuning", row, f"{what}: fwd {row['fwd_tbps']:.2f} TB/s, bwd {row['bwd_tbps']:.2f} TB/s")
        return row

    for launch in [("rms_norm", *v) for v in NORM_LAUNCHES] + list(NORM_OTHERS):
        if norm_variant(*launch) is None:
            return
    s, b, h, d = opts.pick((4096, 4, 32, 128), (4096, 4, 32, 128), (8, 2, 2, 16))
    q = torch.randn(s, b, h, d, generator=g).to(dev, dtype).requires_grad_(True)
    freqs = torch.rand(s, d // 2, generator=g).to(dev)
    dq = torch.randn(s, b, h, d, generator=g).to(dev, dtype)
    size = q.numel() * q.element_size()
    for rows, warps in [(1, w) for w in ROPE_WARPS] + [(r, w) for r in ROPE_ROWS for w in ROPE_ROWS_WARPS]:
        if not record.has_time(f"rope warps {warps} rows {rows}", 3.0):
            return
        with mock.patch.multiple(rope_triton, MAX_WARPS=warps, ROWS_PER_PROGRAM=rows):
            fwd = median_ms(lambda: rope_triton.apply_rope(q, freqs), reps, cuda)
            y = rope_triton.apply_rope(q, freqs)
            bwd = median_ms(lambda: torch.autograd.grad(y, q, dq, retain_graph=True), reps, cuda)
        record.row("tuning", {"kernel": "rope", "warps": warps, "rows_per_iter": rows, "fwd_ms": fwd, "bwd_ms": bwd,
                              "fwd_tbps": 2 * size / fwd / 1e9, "bwd_tbps": 2 * size / bwd / 1e9,
                              "fwd_bwd_tbps": 4 * size / (fwd + bwd) / 1e9},
                   f"rope warps {warps} rows/program {rows}: fwd {2 * size / fwd / 1e9:.2f} TB/s, bwd "
                   f"{2 * size / bwd / 1e9:.2f} TB/s")

"""Section 3b, launch settings of the bandwidth kernels measured side by side: what the goals table's misses
would be changed to (METHOD: measure the variants in one run, then choose).

RMSNorm at 16k rows x 8192 (bf16), in two passes. First, one row a backward loop iteration, the warps per row
program (norm_triton.MAX_WARPS, forward and backward) against the backward programs per multiprocessor
(BWD_PROGRAMS_PER_SM: how many rows each program loops over); 16 programs/SM is left out, the slowest backward
at every warp count on the H100 (2026-11-26). Then, at the programs/SM whose backward was fastest, the backward's
rows a loop iteration (BWD_ROWS_PER_ITER 2 and 4, one [rows, 8192] block) against the warps again: a block of
more rows holds that many times the registers per thread, which more warps spread. The second pass is 8
variants, not the 24 of the full three-way grid, to keep within the section's 20 s (the 16-variant grid and
RoPE took 10 s). RoPE at [4096, 4, 32, 128]: warps per program (rope_triton.MAX_WARPS) at one row a program,
then 2 and 4 (position, sample) rows a program (ROWS_PER_PROGRAM) at 4 and 8 warps. Each variant: median
of device-event timings, TB/s of the fewest bytes (norm forward 2 passes, backward 3; RoPE 2 each way). The
module constants are set for each variant with unittest.mock and restored after it.
"""
from __future__ import annotations

from unittest import mock

import torch

from benchmarks.gpu.context import NEEDS_CUDA
from benchmarks.kernel_speed import median_ms
from kernels import dispatch

NORM_WARPS, NORM_PROGRAMS, NORM_ROWS, ROPE_WARPS = (4, 8, 16, 32), (2, 4, 8), (2, 4), (2, 4, 8, 16)
ROPE_ROWS, ROPE_ROWS_WARPS = (2, 4), (4, 8)  # RoPE's rows per program beyond 1, at the two best warp counts so far


def run(opts, record, earlier) -> None:
    if not opts.cuda or not dispatch.triton_available():  # launch settings mean nothing to the interpreter
        record.skip("launch-setting sweep", NEEDS_CUDA)
        return
    from kernels import norm_triton, rope_triton
    dev, cuda, dtype = "cuda", True, torch.bfloat16
    reps = opts.pick(20, 10, 2)
    m, n = opts.pick((16384, 8192), (16384, 8192), (256, 512))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, n, generator=g).to(dev, dtype).requires_grad_(True)
    w = torch.rand(n, generator=g).to(dev, dtype).requires_grad_(True)
    dy = torch.randn(m, n, generator=g).to(dev, dtype)
    size = m * n * x.element_size()

    def norm_variant(warps: int, per_sm: int, rows: int) -> dict | None:
        what = f"rms_norm warps {warps} programs/SM {per_sm} rows/iter {rows}"
        if not record.has_time(what, 3.0):
            return None
        with mock.patch.multiple(norm_triton, MAX_WARPS=warps, BWD_PROGRAMS_PER_SM=per_sm, BWD_ROWS_PER_ITER=rows):
            fwd = median_ms(lambda: norm_triton.rms_norm(x, w, 1e-5), reps, cuda)
            y = norm_triton.rms_norm(x, w, 1e-5)
            bwd = median_ms(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True), reps, cuda)
        row = {"kernel": "rms_norm", "warps": warps, "programs_per_sm": per_sm, "rows_per_iter": rows, "fwd_ms": fwd,
               "bwd_ms": bwd, "fwd_tbps": 2 * size / fwd / 1e9, "bwd_tbps": 3 * size / bwd / 1e9,
               "fwd_bwd_tbps": 5 * size / (fwd + bwd) / 1e9}
        record.row("tuning", row, f"{what}: fwd {row['fwd_tbps']:.2f} TB/s, bwd {row['bwd_tbps']:.2f} TB/s")
        return row

    grid = []
    for warps in NORM_WARPS:
        for per_sm in NORM_PROGRAMS:
            grid.append(norm_variant(warps, per_sm, 1))
            if grid[-1] is None:
                return
    best_per_sm = max(grid, key=lambda r: r["bwd_tbps"])["programs_per_sm"]
    for rows in NORM_ROWS:
        for warps in NORM_WARPS:
            if norm_variant(warps, best_per_sm, rows) is None:
                return
    s, b, h, d = opts.pick((4096, 4, 32, 128), (4096, 4, 32, 128), (64, 2, 4, 16))
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

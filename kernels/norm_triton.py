"""RMSNorm and LayerNorm in Triton, optionally fused with the residual add that precedes them.

One kernel pair serves all four variants (constexpr flags pick RMS vs mean-centred, bias, residual).
Forward: one program per row, the whole row in registers (hidden sizes up to 64K), fp32 statistics
saved for backward. Backward: a fixed number of programs each walks a stripe of rows, BWD_ROWS_PER_ITER rows
a loop iteration, keeping its share of dweight/dbias in fp32 registers, so the weight gradient is a small
[programs, h] sum instead of atomics or an [M, h] buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536


@triton.jit
def _norm_fwd(X, RES, W, B, Y, SUM_OUT, MEAN, RSTD, stride_x, stride_r, stride_y, stride_s, N, eps,
              IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # Round the sum to the activation dtype first, exactly as `x + residual` would.
        x = x + tl.load(RES + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(SUM_OUT + row * stride_s + cols, x, mask=mask)
    x = x.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, W, DY, DSUM, DX, DW_PART, DB_PART, MEAN, RSTD, stride_x, stride_dy, stride_ds, stride_dx,
              M, N, rows_per_program,
              IS_RMS: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
              ROWS: tl.constexpr):
    # Each iteration takes ROWS rows as one [ROWS, BLOCK] block, so that all their loads are issued before the
    # first reduction waits on them; per-row sums run along axis 1, the dw/db shares add up along axis 0.
    # rows_per_program must be a multiple of ROWS (the launcher rounds it up), so no block reaches into the
    # next program's stripe.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, rows_per_program, ROWS):
        # The last stripe may run past M: its extra rows load x, dy and their statistics as zeros and
        # contribute nothing (zero dy times a zero xhat), nor are they stored.
        rows = pid.to(tl.int64) * rows_per_program + i + tl.arange(0, ROWS)
        row_ok = rows < M
        block_mask = row_ok[:, None] & mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=block_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=block_mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
            xhat = tl.where(block_mask, (x - mean) * rstd, 0.0)
        wdy = w[None, :] * dy
        dw += tl.sum(dy * xhat, axis=0)
        # d/dx of w * xhat: rstd * (w*dy - xhat * mean(w*dy*xhat) [- mean(w*dy) for LayerNorm]).
        dx = wdy - xhat * (tl.sum(wdy * xhat, axis=1) / N)[:, None]
        if not IS_RMS:
            dx -= (tl.sum(wdy, axis=1) / N)[:, None]
            if HAS_BIAS:
                db += tl.sum(dy, axis=0)
        dx *= rstd
        if HAS_DSUM:
            dx += tl.load(DSUM + rows[:, None] * stride_ds + cols[None, :], mask=block_mask,
                          other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=block_mask)
    tl.store(DW_PART + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, db, mask=mask)


# Launch settings, from the sweep of benchmarks/gpu/tuning.py (RMSNorm 16k x 8192 bf16). On the H200 of 2026-11-27,
# with each timed call queued behind a device sleep (earlier sweeps timed host launch work too): the forward 3.98-4.05
# TB/s at 4 to 16 warps a row (2.96 at 32); the backward best at 16 warps, 8 programs per multiprocessor, 2 rows a
# loop iteration, 3.45 TB/s against 2.78-3.16 one row at a time (3.67 forward + backward against 3.38 with the earlier
# settings, 4, 2 and 1: 86% of the card's 4.25 TB/s copy against 80%). Two rows at 4 warps, or four at 8, spilled
# (0.22-0.27 TB/s): 64 fp32 values of each loaded tensor a thread or more.
MAX_WARPS = 16           # warps per row's program (one per 256 elements of the row, at most this)
BWD_PROGRAMS_PER_SM = 8  # backward: programs per multiprocessor, each looping over its rows (dw partial sums)
# Backward rows per loop iteration, loaded as one [rows, BLOCK] block so that more loads are in flight; fewer where a
# thread would hold more than BWD_MAX_PER_THREAD elements of a row block (RMSNorm; LayerNorm, which keeps its means
# and bias gradient too, half as many). ptxas's report for sm_90 (no GPU needed; tests/test_kernels_compile.py) at
# hidden 8192 and 16 warps: RMSNorm spills 156 bytes a thread at 2 rows (the measured best, 3.45 TB/s backward) and
# none at 1; LayerNorm 372 at 2 rows, none at 1; the earlier 4 warps spilled 412 (RMSNorm) and 2,000 (LayerNorm:
# 1.68 TB/s forward + backward on the H200, against RMSNorm's 3.36).
BWD_ROWS_PER_ITER = 2
BWD_MAX_PER_THREAD = 32


def _bwd_rows(block: int, warps: int, is_rms: bool = True) -> int:
    """Backward rows a loop iteration: BWD_ROWS_PER_ITER, halved until a thread holds at most BWD_MAX_PER_THREAD
    elements of the [rows, block] block (half that for LayerNorm)."""
    rows = BWD_ROWS_PER_ITER
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"BWD_ROWS_PER_ITER must be a power of two (a Triton block size), got {rows}")
    most = BWD_MAX_PER_THREAD if is_rms else BWD_MAX_PER_THREAD // 2
    while rows > 1 and rows * block > most * 32 * warps:
        rows //= 2
    return rows


def _launch_config(n: int):
    block = triton.next_power_of_2(n)
    if block > MAX_HIDDEN:
        raise ValueError(f"fused norm supports hidden sizes up to {MAX_HIDDEN}, got {n}")
    warps = min(max(block // 256, 1), MAX_WARPS)
    return block, warps


def _bwd_programs(x: torch.Tensor, rows: int) -> int:
    if x.is_cuda:
        return min(rows, BWD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(x.device).multi_processor_count)
    return min(rows, 4)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        shape = x.shape
        x2 = _rows(x)
        m, n = x2.shape
        block, warps = _launch_config(n)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        has_res = residual is not None
        r2 = _rows(residual) if has_res else x2
        summed = torch.empty_like(y) if has_res else x2
        _norm_fwd[(m,)](x2, r2, weight, bias if bias is not None else weight, y, summed, mean, rstd,
                        x2.stride(0), r2.stride(0), y.stride(0), summed.stride(0), n, eps,
                        IS_RMS=is_rms, HAS_RES=has_res, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(summed, weight, bias, mean, rstd)
        ctx.is_rms, ctx.has_res, ctx.shape = is_rms, has_res, shape
        if has_res:
            return y.view(shape), summed.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        block, warps = _launch_config(n)
        dy2 = _rows(dy)
        has_dsum = ctx.has_res and dsum is not None
        ds2 = _rows(dsum) if has_dsum else dy2
        dx = torch.empty_like(x2)
        rows_per_iter = _bwd_rows(block, warps, ctx.is_rms)
        # Whole iterations per program: a stripe of a multiple of rows_per_iter rows (the kernel relies on it).
        rows_per_program = triton.cdiv(triton.cdiv(m, _bwd_programs(x2, m)), rows_per_iter) * rows_per_iter
        programs = triton.cdiv(m, rows_per_program)
        dw_part = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        db_part = torch.empty_like(dw_part) if bias is not None else dw_part
        _norm_bwd[(programs,)](x2, weight, dy2, ds2, dx, dw_part, db_part, mean, rstd,
                               x2.stride(0), dy2.stride(0), ds2.stride(0), dx.stride(0),
                               m, n, rows_per_program,
                               IS_RMS=ctx.is_rms, HAS_DSUM=has_dsum, HAS_BIAS=bias is not None,
                               BLOCK=block, ROWS=rows_per_iter, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        dx = dx.view(ctx.shape)
        # x and residual receive the same gradient; autograd copies before accumulating into a shared one.
        return dx, (dx if ctx.has_res else None), dw, db, None, None


def rms_norm(x, weight, eps):
    return _FusedNorm.apply(x, None, weight, None, eps, True)


def layer_norm(x, weight, bias, eps):
    return _FusedNorm.apply(x, None, weight, bias, eps, False)


def add_rms_norm(x, residual, weight, eps):
    return _FusedNorm.apply(x, residual, weight, None, eps, True)


def add_layer_norm(x, residual, weight, bias, eps):
    return _FusedNorm.apply(x, residual, weight, bias, eps, False)

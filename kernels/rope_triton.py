"""Rotary position embedding in Triton (rotate-half convention, pairs (i, i + d/2)).

One program per (position, batch) row (or ROWS_PER_PROGRAM of them) rotates all heads of that row, so cos/sin of
the row's angles are computed once and reused across heads. The angles are a table [s, d/2] shared by the samples, or [s, b, d/2]
when each sample has its own positions (packed documents under --reset-position-ids): the table's sample
stride is 0 in the first case, so both read their row the same way. The backward pass is the same rotation by
the negated angle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, FREQS, Y, BATCH, TOTAL, stride_xs, stride_xb, stride_xh, stride_fs, stride_fb, NH, HALF, sign,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    # ROWS (position, sample) rows a program, unrolled so that the rows' loads can all be in flight at once; a
    # row past TOTAL (the last program's) is masked whole. (The interpreter takes no scalar mask: the row test is
    # made a block first.)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    for r in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        live = (heads * 0 + row) < TOTAL
        pos = row // BATCH
        bat = row % BATCH
        mask = (heads < NH) & (dims < HALF) & live
        theta = tl.load(FREQS + pos * stride_fs + bat * stride_fb + dims, mask=(dims < HALF) & (dims * 0 + row <
                        TOTAL), other=0.0).to(tl.float32)
        cos = tl.cos(theta)
        sin = tl.sin(theta) * sign
        x_row = X + pos * stride_xs + bat * stride_xb + heads * stride_xh + dims
        x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
        # Output is contiguous [s, b, n, d].
        y_row = Y + row * NH * 2 * HALF + heads * 2 * HALF + dims
        tl.store(y_row, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
        tl.store(y_row + HALF, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


# warps per program: one per 256 rotated pairs, at most this; the H100 sweep (benchmarks/gpu/tuning.py,
# [4096, 4, 32, 128] bf16) gave 4 warps 1.68 TB/s forward + backward against 1.42 at 8
MAX_WARPS = 4
# (position, sample) rows per program (1: one, as measured above). Untested on a GPU at 2 or 4: a program of one
# row moves only 2 x heads x d elements, and the sweep decides whether more rows a program reach more bandwidth.
ROWS_PER_PROGRAM = 1


def _rotate(x: torch.Tensor, freqs: torch.Tensor, sign: float) -> torch.Tensor:
    s, b, n, d = x.shape
    if d % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {d}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((s, b, n, d), dtype=x.dtype, device=x.device)
    block_h = triton.next_power_of_2(n)
    block_d = triton.next_power_of_2(d // 2)
    warps = min(max(block_h * block_d // 256, 1), MAX_WARPS)
    per_sample = freqs.stride(1) if freqs.dim() == 3 else 0
    rows = ROWS_PER_PROGRAM
    _rope_kernel[(triton.cdiv(s * b, rows),)](x, freqs, y, b, s * b, x.stride(0), x.stride(1), x.stride(2),
                                              freqs.stride(0), per_sample, n, d // 2, sign, BLOCK_H=block_h,
                                              BLOCK_D=block_d, ROWS=rows, num_warps=warps)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        return _rotate(x, freqs, 1.0)

    @staticmethod
    def backward(ctx, dy):
        (freqs,) = ctx.saved_tensors
        return _rotate(dy, freqs, -1.0), None


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    if freqs.stride(-1) != 1:
        freqs = freqs.contiguous()
    return _Rope.apply(x, freqs)

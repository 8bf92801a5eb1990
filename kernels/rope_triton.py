"""Rotary position embedding in Triton (rotate-half convention, pairs (i, i + d/2)).

One program per (position, batch) row rotates all heads of that row, so cos/sin of the row's angles are
computed once and reused across heads. The angles are a table [s, d/2] shared by the samples, or [s, b, d/2]
when each sample has its own positions (packed documents under --reset-position-ids): the table's sample
stride is 0 in the first case, so both read their row the same way. The backward pass is the same rotation by
the negated angle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, FREQS, Y, BATCH, stride_xs, stride_xb, stride_xh, stride_fs, stride_fb, NH, HALF, sign,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    pos = pid // BATCH
    bat = pid % BATCH
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NH) & (dims < HALF)
    theta = tl.load(FREQS + pos * stride_fs + bat * stride_fb + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    cos = tl.cos(theta)
    sin = tl.sin(theta) * sign
    x_row = X + pos.to(tl.int64) * stride_xs + bat.to(tl.int64) * stride_xb + heads * stride_xh + dims
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    # Output is contiguous [s, b, n, d].
    y_row = Y + pid.to(tl.int64) * NH * 2 * HALF + heads * 2 * HALF + dims
    tl.store(y_row, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + HALF, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


# warps per (position, sample) program: one per 256 rotated pairs, at most this; the H100 sweep
# (benchmarks/gpu/tuning.py, [4096, 4, 32, 128] bf16) gave 4 warps 1.68 TB/s forward + backward against 1.42 at 8
MAX_WARPS = 4


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
    _rope_kernel[(s * b,)](x, freqs, y, b, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0), per_sample, n,
                           d // 2, sign, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)
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

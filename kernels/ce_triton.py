"""Cross-entropy primitives over one vocabulary shard in Triton, streaming the logits in their own dtype.

`ce_stats` walks each row once keeping a running max and rescaled sum of exponentials per lane (merged
at the end, so the loop has no cross-lane reduction); `ce_grad` writes the gradient block by block,
optionally over the logits themselves. Neither ever holds more than a block of fp32 values per row, so
the extra memory is O(rows), not an fp32 copy of [rows, vocab].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _ce_stats(LOGITS, TARGET, MAX, SUMEXP, TLOGIT, stride_row, vocab_start, valid_cols, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    # A finite floor instead of -inf keeps exp(m_old - m_new) defined in lanes that never see a column.
    m = tl.full((BLOCK_V,), -1e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, valid_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < valid_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    tl.store(MAX + row, row_max)
    tl.store(SUMEXP + row, tl.sum(s * tl.exp(m - row_max), axis=0))
    local = tl.load(TARGET + row) - vocab_start
    in_shard = (local >= 0) & (local < valid_cols)
    t = tl.load(base + local, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(TLOGIT + row, tl.where(in_shard, t, 0.0))


@triton.jit
def _ce_grad(LOGITS, OUT, TARGET, LSE, COEF_S, COEF_O, stride_row, stride_out, vocab_start, valid_cols, n_cols,
             BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < valid_cols
    x = tl.load(LOGITS + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    g = tl.exp(x - tl.load(LSE + row)) * tl.load(COEF_S + row)
    local = tl.load(TARGET + row) - vocab_start
    g -= tl.where((cols == local) & valid, tl.load(COEF_O + row), 0.0)
    # Padding columns get exactly 0 (exp(-inf) is 0; the target is never a padding column).
    tl.store(OUT + row * stride_out + cols, g.to(OUT.dtype.element_ty), mask=cols < n_cols)


def _check(logits, valid_cols):
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"cross-entropy kernels need [N, V] logits with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if not 0 < valid_cols <= logits.shape[1]:
        raise ValueError(f"valid_cols must be in 1..{logits.shape[1]}, got {valid_cols}")


def ce_stats(logits, target, vocab_start, valid_cols):
    _check(logits, valid_cols)
    n = logits.shape[0]
    out = torch.zeros((3, n), dtype=torch.float32, device=logits.device)
    if n == 0:
        return out[0], out[1], out[2]
    block = min(BLOCK_V, triton.next_power_of_2(valid_cols))
    _ce_stats[(n,)](logits, target.contiguous(), out[0], out[1], out[2], logits.stride(0), vocab_start, valid_cols,
                    BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
    return out[0], out[1], out[2]


def ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax, coef_onehot, inplace=False):
    _check(logits, valid_cols)
    n, v = logits.shape
    out = logits if inplace else torch.empty_like(logits)
    if n == 0:
        return out
    block = min(BLOCK_V, triton.next_power_of_2(v))
    rowvec = [t.float().contiguous() for t in (lse, coef_softmax, coef_onehot)]
    _ce_grad[(n, triton.cdiv(v, block))](logits, out, target.contiguous(), *rowvec,
                                         logits.stride(0), out.stride(0), vocab_start, valid_cols, v,
                                         BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
    return out

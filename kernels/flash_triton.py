"""Flash attention in Triton: causal or full, grouped-query, forward and backward, saving the log-sum-exp.

The algorithm is FlashAttention-2 (Dao, 2023, arXiv:2307.08691): the forward pass streams key/value
blocks past a resident query block with an online softmax and saves only the per-row log-sum-exp; the
backward pass recomputes the probabilities from it. Backward is split into two kernels so no atomics
are needed: one owns a key/value block and loops over the query blocks (and, for grouped-query
attention, over every query head of its group) to accumulate dK and dV; the other owns a query block
and loops over key blocks to accumulate dQ.

Tensors stay in the engine's [b, s, heads, d] layout; strides carry it, so nothing is transposed.
Causal masking is applied only on blocks that straddle the diagonal (a constexpr MASK flag compiles a
mask-free copy of each loop for the rest). Queries and keys have the same length (training).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Kernels may only read module globals that are constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
DELTA_BLOCK = 32  # rows per program of the rowsum(O * dO) pre-pass; small keeps it spill-free at d=128


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo, hi, offs_m, offs_n, offs_d, S, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < S
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASK:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        # Every row has at least one visible column in its first block, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, sm_scale,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
              NQ, GROUP, S,
              CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # Grid is (heads, query blocks); the last query blocks carry the most causal work, so start there.
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = (pid_bh // NQ).to(tl.int64)
    h = pid_bh % NQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_m[:, None] < S) & (offs_d[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=io_mask, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    qk_scale = sm_scale * LOG2E
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if CAUSAL:
        # Blocks left of this query block are fully visible; the ones on the diagonal need the mask.
        hi_full = pid_m * BLOCK_M
        hi = tl.minimum((pid_m + 1) * BLOCK_M, S)
    else:
        hi_full = (S // BLOCK_N) * BLOCK_N
        hi = S
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, sks, svs, 0, hi_full, offs_m, offs_n, offs_d, S,
                               qk_scale, False, CAUSAL, D, BLOCK_N, PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, sks, svs, hi_full, hi, offs_m, offs_n, offs_d, S,
                               qk_scale, True, CAUSAL, D, BLOCK_N, PRECISION)
    acc = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], acc.to(O.dtype.element_ty), mask=io_mask)
    # Saved in natural-log units: lse = ln(sum_j exp(scale * q.k_j)).
    tl.store(LSE + pid_bh.to(tl.int64) * S + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=offs_m < S)


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, sob, sos, soh, sdb, sds, sdh, NQ, S,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // NQ).to(tl.int64)
    h = pid_bh % NQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < S) & (offs_d[None, :] < D)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * S + offs_m, delta, mask=offs_m < S)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqs, sds, lo, hi, offs_n, offs_d, S, qk_scale,
                MASK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < S
        # Query rows past S load as zeros (q, dO, delta and lse), which makes their dK/dV terms exactly 0.
        qt = tl.load(q_base + offs_m[None, :] * sqs + offs_d[:, None], mask=m_ok[None, :] & d_ok[:, None], other=0.0)
        lse2 = tl.load(lse_base + offs_m, mask=m_ok, other=0.0) * LOG2E
        pt = tl.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale - lse2[None, :])
        if MASK:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        do = tl.load(do_base + offs_m[:, None] * sds + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, sm_scale,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                   NQ, NKV, GROUP, S,
                   CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # Grid is (kv heads, key blocks); the first key blocks carry the most causal work and launch first.
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // NKV).to(tl.int64)
    hk = pid_bh % NKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < S) & (offs_d[None, :] < D)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        row_base = (b * NQ + h) * S
        if CAUSAL:
            # Query rows before start_n never see this block; rows on the diagonal block need the mask.
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqs, sds,
                                 start_n, tl.minimum(start_n + BLOCK_N, S), offs_n, offs_d, S, qk_scale,
                                 True, D, BLOCK_M, PRECISION)
            lo = start_n + BLOCK_N
        else:
            lo = 0
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqs, sds,
                             lo, S, offs_n, offs_d, S, qk_scale, False, D, BLOCK_M, PRECISION)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, sks, svs, lo, hi, offs_m, offs_d, S, qk_scale,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        n_ok = cols < S
        kt = tl.load(k_base + cols[None, :] * sks + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vt = tl.load(v_base + cols[None, :] * svs + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse2[:, None])
        if MASK:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, sm_scale,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh,
                 NQ, GROUP, S,
                 CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    # Grid is (heads, query blocks); the last query blocks carry the most causal work, so start there.
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    b = (pid_bh // NQ).to(tl.int64)
    h = pid_bh % NQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    io_mask = m_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :], mask=io_mask, other=0.0)
    row_base = pid_bh.to(tl.int64) * S
    lse2 = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if CAUSAL:
        hi_full = pid_m * BLOCK_M
        hi = tl.minimum((pid_m + 1) * BLOCK_M, S)
    else:
        # Only the last, partial key block needs masking (zero-padded keys would still get probability).
        hi_full = (S // BLOCK_N) * BLOCK_N
        hi = S
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, sks, svs, 0, hi_full, offs_m, offs_d, S, qk_scale,
                   False, CAUSAL, D, BLOCK_N, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, sks, svs, hi_full, hi, offs_m, offs_d, S, qk_scale,
                   True, CAUSAL, D, BLOCK_N, PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=io_mask)


def _configs(d: int, dtype: torch.dtype, on_gpu: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dK/dV and dQ kernels.

    Each kernel's outer block is a multiple of its inner block (the diagonal logic relies on it). The GPU
    choices are the spill-free (or nearly: dK/dV at d=128 spills 40 bytes) ones among those compiled for
    sm_90 with ptxas -v; fp32 and wide heads get small tiles to fit shared memory. The interpreter gets
    small blocks so tests cross several blocks, partial blocks and the diagonal on tiny inputs.
    """
    if not on_gpu:
        return (32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1)
    if d > 128 or dtype == torch.float32:
        return (64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2)
    if d <= 64:
        return (128, 64, 4, 3), (32, 128, 8, 2), (128, 64, 8, 3)
    return (128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 3)


def _precision(q):
    # fp32 inputs get three-pass tf32 products, fp32-accurate on tensor cores (plain tf32 keeps only a
    # 10-bit mantissa; "ieee" falls back to FMA loops that spill heavily). Half types ignore this.
    return "tf32x3" if q.dtype == torch.float32 else "tf32"


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _check(q, k, v):
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] \
            or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"flash attention needs q [b, s, nq, d] and k, v [b, s, nkv, d] with nq % nkv == 0, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[3] > 256:
        raise ValueError(f"flash attention supports head dims up to 256, got {q.shape[3]}")


def _last_contiguous(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def forward(q, k, v, causal=True, softmax_scale=None):
    """Returns (out [b, s, nq, d], lse [b, nq, s] fp32, natural log)."""
    _check(q, k, v)
    q, k, v = _last_contiguous(q, k, v)
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    (bm, bn, warps, stages), _, _ = _configs(d, q.dtype, q.is_cuda)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, nq, s), dtype=torch.float32, device=q.device)
    _attn_fwd[(b * nq, triton.cdiv(s, bm))](
        q, k, v, out, lse, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(out), nq, nq // nkv, s,
        CAUSAL=causal, D=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=_precision(q),
        num_warps=warps, num_stages=stages)
    return out, lse


def backward(do, q, k, v, out, lse, causal=True, softmax_scale=None):
    """Returns (dq, dk, dv) for the forward above."""
    (do,) = _last_contiguous(do)
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    _, (m1, n1, warps1, stages1), (m2, n2, warps2, stages2) = _configs(d, q.dtype, q.is_cuda)
    block_d = max(16, triton.next_power_of_2(d))
    delta = torch.empty_like(lse)
    _attn_bwd_delta[(triton.cdiv(s, DELTA_BLOCK), b * nq)](out, do, delta, *_strides(out), *_strides(do), nq, s,
                                                           D=d, BLOCK_M=DELTA_BLOCK, BLOCK_D=block_d)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    _attn_bwd_dkdv[(b * nkv, triton.cdiv(s, n1))](
        q, k, v, do, dk, dv, lse, delta, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), nq, nkv, nq // nkv, s,
        CAUSAL=causal, D=d, BLOCK_M=m1, BLOCK_N=n1, BLOCK_D=block_d, PRECISION=_precision(q),
        num_warps=warps1, num_stages=stages1)
    _attn_bwd_dq[(b * nq, triton.cdiv(s, m2))](
        q, k, v, do, dq, lse, delta, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        nq, nq // nkv, s,
        CAUSAL=causal, D=d, BLOCK_M=m2, BLOCK_N=n2, BLOCK_D=block_d, PRECISION=_precision(q),
        num_warps=warps2, num_stages=stages2)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        q, k, v = _last_contiguous(q, k, v)
        out, lse = forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, out, lse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal=True, softmax_scale=None):
    return _FlashAttention.apply(q, k, v, causal, softmax_scale)

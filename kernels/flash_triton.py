"""Flash attention in Triton: causal or full, with a sliding window and packed documents, grouped-query, forward
and backward, saving the log-sum-exp.

The algorithm is FlashAttention-2 (Dao, 2023, arXiv:2307.08691): the forward pass streams key/value
blocks past a resident query block with an online softmax and saves only the per-row log-sum-exp; the
backward pass recomputes the probabilities from it. Backward is split into two kernels so no atomics
are needed: one owns a key/value block and loops over the query blocks (and, for grouped-query
attention, over every query head of its group) to accumulate dK and dV; the other owns a query block
and loops over key blocks to accumulate dQ.

Tensors stay in the engine's [b, s, heads, d] layout; strides carry it, so nothing is transposed. The
mask is a causal rule, an optional sliding window and optional documents on absolute positions (`doc_bounds`
[2, b, S] int32: the first and the last position of each position's document, the whole sequence's, so a
context-parallel block reads its rows at their positions); the programs, in kernels/flash_triton_jit.py, skip
the blocks it hides and mask only the blocks on its edges. Queries and keys have the same length (training).
`counting()` counts the blocks the loops visit, so a test can see the skipping.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import triton

from kernels.flash_triton_jit import DELTA_BLOCK, _attn_bwd_delta, _attn_bwd_dkdv, _attn_bwd_dq, _attn_fwd

KERNELS = ("forward", "dkdv", "dq")
_counts: Optional[dict] = None  # inside counting(): blocks visited by each kernel's loops


def _configs(d: int, dtype: torch.dtype, on_gpu: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dK/dV and dQ kernels.

    The GPU choices spill least among those compiled for sm_90 with ptxas -v that keep Hopper's wgmma products
    (tests/test_kernels_compile.py checks the bound): at d=128 dK/dV spills 248 bytes a thread at (32, 64, 8, 2);
    (64, 64, 8, 3), its launch until 2026-11-27, spills 1,320 with the kernel as it is now (this docstring said 40
    when it was chosen), and tiles of 32 keys spill less still but fall back to mma.sync. dQ at d=128 spills 24
    bytes. The forward at d=64 runs 8 warps: at 4 it spilled up to 456 bytes with a window or documents (none
    without); everything at d=64 spills at most 44 now. fp32 and wide heads get small tiles to fit shared memory;
    fp32 still spills (d=128: up to 2.5 KB a thread in the backward, three-pass tf32 products), untuned. The
    interpreter gets small blocks so tests cross several blocks, partial blocks and the diagonal on tiny inputs.
    """
    if not on_gpu:
        return (32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1)
    if d > 128 or dtype == torch.float32:
        return (64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2)
    if d <= 64:
        return (128, 64, 8, 3), (32, 128, 8, 2), (128, 64, 8, 3)
    return (128, 64, 8, 3), (32, 64, 8, 2), (128, 64, 8, 3)


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


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """Count the blocks the kernels' loops visit, summed over programs: key blocks per query block (forward,
    dQ), query blocks per key block and query head (dK/dV). A test hook: the counter is an atomic per visit."""
    global _counts
    previous, _counts = _counts, dict.fromkeys(KERNELS, 0)
    try:
        yield _counts
    finally:
        _counts = previous


def _visits(device) -> torch.Tensor:
    """The counter a launch adds its visits to (never written outside counting(): no memset then)."""
    return torch.zeros(1, dtype=torch.int32, device=device) if _counts is not None else \
        torch.empty(1, dtype=torch.int32, device=device)


def _counted(kernel: str, visits: torch.Tensor) -> None:
    if _counts is not None:
        _counts[kernel] += int(visits.item())


def _mask_args(causal: bool, window: Optional[int], q_offset: int, k_offset: int, doc_bounds) -> dict:
    """The launch arguments of the mask: query and key positions as one shift and as offsets (the documents are
    read at absolute positions), the window and the documents each as a flag and a value."""
    return dict(shift=q_offset - k_offset, window=window or 0, q_offset=q_offset, k_offset=k_offset, CAUSAL=causal,
                WINDOWED=window is not None, DOCUMENTS=doc_bounds is not None, COUNT=_counts is not None)


def _documents(doc_bounds, device) -> tuple:
    """(pointer, sample stride, distance from the first bounds to the last) of the documents, or of a stand-in
    never read when there are none."""
    if doc_bounds is None:
        return torch.zeros(1, dtype=torch.int32, device=device), 0, 0
    return doc_bounds, doc_bounds.stride(1), doc_bounds.stride(0)


def forward(q, k, v, causal=True, softmax_scale=None, window=None, q_offset=0, k_offset=0, doc_bounds=None):
    """Returns (out [b, s, nq, d], lse [b, nq, s] fp32, natural log). `window`: keys at most this many positions
    before the query (None: all); q_offset/k_offset: the positions of the first query and key (a context-
    parallel block); `doc_bounds`: the documents (None: one sequence). A row that sees no key gets out 0 and
    lse -inf."""
    _check(q, k, v)
    q, k, v = _last_contiguous(q, k, v)
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    (bm, bn, warps, stages), _, _ = _configs(d, q.dtype, q.is_cuda)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, nq, s), dtype=torch.float32, device=q.device)
    visits = _visits(q.device)
    docs, doc_sb, doc_side = _documents(doc_bounds, q.device)
    _attn_fwd[(b * nq, triton.cdiv(s, bm))](
        q, k, v, out, lse, visits, docs, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(out), doc_sb,
        doc_side, nq, nq // nkv, s, **_mask_args(causal, window, q_offset, k_offset, doc_bounds), D=d, BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=_precision(q), num_warps=warps, num_stages=stages)
    _counted("forward", visits)
    return out, lse


def backward(do, q, k, v, out, lse, causal=True, softmax_scale=None, window=None, q_offset=0, k_offset=0,
             doc_bounds=None):
    """Returns (dq, dk, dv) for the forward above; `lse` is the whole row's (a context-parallel merge's). A
    cotangent in another dtype than q's (fp32 from a caller that merged in fp32) is taken in q's: the kernels'
    dot products need one operand type (the first H100 run found the tests handing bf16 blocks an fp32 one)."""
    (do,) = _last_contiguous(do.to(q.dtype))
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    _, (m1, n1, warps1, stages1), (m2, n2, warps2, stages2) = _configs(d, q.dtype, q.is_cuda)
    block_d = max(16, triton.next_power_of_2(d))
    mask = _mask_args(causal, window, q_offset, k_offset, doc_bounds)
    docs, doc_sb, doc_side = _documents(doc_bounds, q.device)
    delta = torch.empty_like(lse)
    _attn_bwd_delta[(triton.cdiv(s, DELTA_BLOCK), b * nq)](out, do, delta, *_strides(out), *_strides(do), nq, s,
                                                           D=d, BLOCK_M=DELTA_BLOCK, BLOCK_D=block_d)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    visits = _visits(q.device), _visits(q.device)
    _attn_bwd_dkdv[(b * nkv, triton.cdiv(s, n1))](
        q, k, v, do, dk, dv, lse, delta, visits[0], docs, scale, *_strides(q), *_strides(k), *_strides(v),
        *_strides(do), *_strides(dk), *_strides(dv), doc_sb, doc_side, nq, nkv, nq // nkv, s, **mask, D=d, BLOCK_M=m1,
        BLOCK_N=n1, BLOCK_D=block_d, PRECISION=_precision(q), num_warps=warps1, num_stages=stages1)
    _attn_bwd_dq[(b * nq, triton.cdiv(s, m2))](
        q, k, v, do, dq, lse, delta, visits[1], docs, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), doc_sb, doc_side, nq, nq // nkv, s, **mask, D=d, BLOCK_M=m2, BLOCK_N=n2, BLOCK_D=block_d,
        PRECISION=_precision(q), num_warps=warps2, num_stages=stages2)
    _counted("dkdv", visits[0])
    _counted("dq", visits[1])
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window, doc_bounds):
        q, k, v = _last_contiguous(q, k, v)
        out, lse = forward(q, k, v, causal, softmax_scale, window, doc_bounds=doc_bounds)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.window, ctx.doc_bounds = causal, softmax_scale, window, doc_bounds
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.window,
                              doc_bounds=ctx.doc_bounds)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=True, softmax_scale=None, window=None, doc_bounds=None):
    return _FlashAttention.apply(q, k, v, causal, softmax_scale, window, doc_bounds)

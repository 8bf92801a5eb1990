"""The Triton programs of flash attention, which kernels/flash_triton.py launches (and describes): the forward,
the rowsum(O * dO) pre-pass, dK/dV and dQ, and the two helpers of the mask every loop shares.

Which keys a query sees is decided from positions (engine/attention_mask.py's rule): query row m and key
row n are shift + m - n apart (shift = q_offset - k_offset: a context-parallel block's queries and keys
come from different places in the sequence), and the pair is visible iff that distance is >= 0 (causal)
and <= window (a sliding window), and, with packed documents (DOCUMENTS), iff the key's position lies
between the first and the last position of the query's document, which is the same as the query's lying
within the key's document: DOCS holds both bounds of every position of the whole sequence ([2, b, S_total]
int32), so each program reads those of its own rows at their absolute positions (`_doc_rows`). Each program
works out from the distances of its rows, and from their documents, which blocks of the other side hold any
visible pair (`_span`): the rest are never loaded, so a batch of packed documents costs the sum of their
squares, not the square of the sample, and of those visited only the ones on an edge of the visible band are
masked (a constexpr MASK flag compiles a mask-free copy of each loop for the others). With COUNT set, every
loop iteration adds one to VISITS (a test hook).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Kernels may only read module globals that are constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
DELTA_BLOCK = 32  # rows per program of the rowsum(O * dO) pre-pass; small keeps it spill-free at d=128


@triton.jit
def _span(a0, a_end, S, shift, least, most, doc_lo, doc_full_lo, doc_full_hi, doc_hi, HAS_LEAST: tl.constexpr,
          HAS_MOST: tl.constexpr, BLOCK: tl.constexpr):
    """(lo, full_lo, full_hi, hi) of the rows b (0 <= b < S) the loop visits for the program's rows a0 <= a <
    a_end, where (a, b) is visible iff least <= shift + a - b <= most and b lies in a's document: [lo, hi) holds
    every b visible to some a (each a sees one run of b, and the runs of consecutive rows meet), [full_lo,
    full_hi), whole blocks, the b visible to every a (no mask). The documents of the rows reach [doc_lo,
    doc_hi) and all of them [doc_full_lo, doc_full_hi) (0, 0, S, S without documents). lo, full_lo, full_hi
    are multiples of BLOCK, or clamped to an end where a segment is empty."""
    hi = tl.minimum(tl.maximum(doc_hi, 0), S)
    full_hi = tl.minimum(tl.maximum(doc_full_hi, 0), S)
    lo = tl.maximum(doc_lo, 0)
    full_lo = tl.maximum(doc_full_lo, 0)
    if HAS_LEAST:
        hi = tl.minimum(hi, tl.maximum(a_end + shift - least, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(a0 + shift - least + 1, 0))
    if HAS_MOST:
        lo = tl.maximum(lo, a0 + shift - most)
        full_lo = tl.maximum(full_lo, a_end - 1 + shift - most)
    lo = tl.minimum(lo // BLOCK * BLOCK, hi)
    full_lo = (full_lo + BLOCK - 1) // BLOCK * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(full_hi // BLOCK * BLOCK, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _keep(keep, dist, window, other, first, last, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
          DOCUMENTS: tl.constexpr):
    """`keep` narrowed to the pairs whose distance (query position - key position) the mask allows and, with
    documents, whose other side's position `other` lies within the document [first, last] of this side's row."""
    if CAUSAL:
        keep = keep & (dist >= 0)
    if WINDOWED:
        keep = keep & (dist <= window)
    if DOCUMENTS:
        keep = keep & (other >= first) & (other <= last)
    return keep


@triton.jit
def _doc_rows(DOCS, doc_side, S, pos, ok, other_offset, DOCUMENTS: tl.constexpr):
    """(first, last, doc_lo, doc_full_lo, doc_full_hi, doc_hi): the documents of this program's rows (absolute
    positions `pos`, those with `ok`; DOCS points at the sample's first bounds, its last ones doc_side further)
    and, as rows of the other side (whose first row is at `other_offset`), the ones some row's document reaches
    and the ones every row's does: the document arguments of `_span`. Without documents: nothing loaded."""
    if DOCUMENTS:
        first = tl.load(DOCS + pos, mask=ok, other=0)
        last = tl.load(DOCS + doc_side + pos, mask=ok, other=0)
        doc_lo = tl.min(tl.where(ok, first, 1 << 30)) - other_offset
        doc_full_lo = tl.max(tl.where(ok, first, -(1 << 30))) - other_offset
        doc_full_hi = tl.min(tl.where(ok, last, 1 << 30)) + 1 - other_offset
        doc_hi = tl.max(tl.where(ok, last, -(1 << 30))) + 1 - other_offset
    else:
        first = pos
        last = pos
        doc_lo = S * 0
        doc_full_lo = S * 0
        doc_full_hi = S
        doc_hi = S
    return first, last, doc_lo, doc_full_lo, doc_full_hi, doc_hi


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo, hi, offs_m, offs_n, offs_d, S, qk_scale,
               shift, window, k_offset, first, last, VISITS, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        if COUNT:
            tl.atomic_add(VISITS, 1)
        cols = start_n + offs_n
        n_ok = cols < S
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASK:
            keep = _keep(n_ok[None, :], shift + offs_m[:, None] - cols[None, :], window, k_offset + cols[None, :],
                         first[:, None], last[:, None], CAUSAL, WINDOWED, DOCUMENTS)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if MASK:  # a row may have seen no key yet (a window's edge, a context-parallel block): subtract 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, VISITS, DOCS, sm_scale,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, doc_sb, doc_side,
              NQ, GROUP, S, shift, window, q_offset, k_offset,
              CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              PRECISION: tl.constexpr):
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
    # Key blocks: the window's or the documents' trailing edge (masked), wholly visible ones, the diagonal's edge.
    first, last, d_lo, d_full_lo, d_full_hi, d_hi = _doc_rows(DOCS + b * doc_sb, doc_side, S, q_offset + offs_m,
                                                              offs_m < S, k_offset, DOCUMENTS)
    lo, full_lo, full_hi, hi = _span(pid_m * BLOCK_M, tl.minimum((pid_m + 1) * BLOCK_M, S), S, shift, 0, window,
                                     d_lo, d_full_lo, d_full_hi, d_hi, CAUSAL, WINDOWED, BLOCK_N)
    for part in tl.static_range(3):
        start = lo if part == 0 else full_lo if part == 1 else full_hi
        end = full_lo if part == 0 else full_hi if part == 1 else hi
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, sks, svs, start, end, offs_m, offs_n, offs_d, S,
                                   qk_scale, shift, window, k_offset, first, last, VISITS, part != 1, CAUSAL,
                                   WINDOWED, DOCUMENTS, COUNT, D, BLOCK_N, PRECISION)
    # A row that sees no key here (only in a context-parallel block) gives 0 with lse -inf, its merge weight.
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], acc.to(O.dtype.element_ty), mask=io_mask)
    # Saved in natural-log units: lse = ln(sum_j exp(scale * q.k_j)).
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * S + offs_m, lse, mask=offs_m < S)


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
                shift, window, q_offset, first, last, VISITS, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_m in range(lo, hi, BLOCK_M):
        if COUNT:
            tl.atomic_add(VISITS, 1)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < S
        # Query rows past S load as zeros (q, dO, delta and lse), which makes their dK/dV terms exactly 0.
        qt = tl.load(q_base + offs_m[None, :] * sqs + offs_d[:, None], mask=m_ok[None, :] & d_ok[:, None], other=0.0)
        lse2 = tl.load(lse_base + offs_m, mask=m_ok, other=0.0) * LOG2E
        pt = tl.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale - lse2[None, :])
        if MASK:
            keep = _keep(m_ok[None, :], shift + offs_m[None, :] - offs_n[:, None], window, q_offset + offs_m[None, :],
                         first[:, None], last[:, None], CAUSAL, WINDOWED, DOCUMENTS)
            pt = tl.where(keep, pt, 0.0)
        do = tl.load(do_base + offs_m[:, None] * sds + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, VISITS, DOCS, sm_scale,
                   sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                   doc_sb, doc_side, NQ, NKV, GROUP, S, shift, window, q_offset, k_offset,
                   CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr):
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
    # Query blocks seen from the keys: the diagonal's edge (masked), wholly visible ones, the window's or the
    # documents' edge; a key's document holds the queries that see it.
    first, last, d_lo, d_full_lo, d_full_hi, d_hi = _doc_rows(DOCS + b * doc_sb, doc_side, S, k_offset + offs_n,
                                                              offs_n < S, q_offset, DOCUMENTS)
    lo, full_lo, full_hi, hi = _span(start_n, tl.minimum(start_n + BLOCK_N, S), S, -shift, -window, 0, d_lo,
                                     d_full_lo, d_full_hi, d_hi, WINDOWED, CAUSAL, BLOCK_M)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        row_base = (b * NQ + h) * S
        for part in tl.static_range(3):
            start = lo if part == 0 else full_lo if part == 1 else full_hi
            end = full_lo if part == 0 else full_hi if part == 1 else hi
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, sqs, sds, start,
                                 end, offs_n, offs_d, S, qk_scale, shift, window, q_offset, first, last, VISITS,
                                 part != 1, CAUSAL, WINDOWED, DOCUMENTS, COUNT, D, BLOCK_M, PRECISION)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, sks, svs, lo, hi, offs_m, offs_d, S, qk_scale,
              shift, window, k_offset, first, last, VISITS, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        if COUNT:
            tl.atomic_add(VISITS, 1)
        cols = start_n + tl.arange(0, BLOCK_N)
        n_ok = cols < S
        kt = tl.load(k_base + cols[None, :] * sks + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vt = tl.load(v_base + cols[None, :] * svs + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, kt, input_precision=PRECISION) * qk_scale - lse2[:, None])
        if MASK:
            keep = _keep(n_ok[None, :], shift + offs_m[:, None] - cols[None, :], window, k_offset + cols[None, :],
                         first[:, None], last[:, None], CAUSAL, WINDOWED, DOCUMENTS)
            p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, VISITS, DOCS, sm_scale,
                 sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh, doc_sb, doc_side,
                 NQ, GROUP, S, shift, window, q_offset, k_offset,
                 CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, COUNT: tl.constexpr,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 PRECISION: tl.constexpr):
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
    # The forward's key blocks; the partial last one is masked too (zero-padded keys would get probability).
    first, last, d_lo, d_full_lo, d_full_hi, d_hi = _doc_rows(DOCS + b * doc_sb, doc_side, S, q_offset + offs_m,
                                                              m_ok, k_offset, DOCUMENTS)
    lo, full_lo, full_hi, hi = _span(pid_m * BLOCK_M, tl.minimum((pid_m + 1) * BLOCK_M, S), S, shift, 0, window,
                                     d_lo, d_full_lo, d_full_hi, d_hi, CAUSAL, WINDOWED, BLOCK_N)
    for part in tl.static_range(3):
        start = lo if part == 0 else full_lo if part == 1 else full_hi
        end = full_lo if part == 0 else full_hi if part == 1 else hi
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, sks, svs, start, end, offs_m, offs_d, S, qk_scale,
                       shift, window, k_offset, first, last, VISITS, part != 1, CAUSAL, WINDOWED, DOCUMENTS, COUNT,
                       D, BLOCK_N, PRECISION)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=io_mask)



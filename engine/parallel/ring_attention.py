"""Causal attention over a context-parallel group: every query sees every earlier key, exactly.

Each CP rank holds two chunks of every sequence (engine/parallel/context_split.py) and their q, k and v.
The keys and values of the other ranks reach it in one of two ways (`--cp-comm-type`):
- p2p: round a ring. At step i a rank holds the K/V of rank (r - i) mod cp, sends it on to r + 1 and
  receives the next from r - 1, one batched isend/irecv per step posted before the step's attention, so
  the transfer overlaps the compute. Every rank posts the same operations in the same order, which is
  deadlock-free under nccl's rules. Backward passes K/V round again, and with them the dK/dV accumulated
  so far for their owner; after cp steps each dK/dV has come home.
- all_gather: K/V gathered once (as Llama 3 trained), dK/dV reduce-scattered back in backward.
Both visit the owners in the same order, so their forward results are identical.

The work between a query chunk and a key chunk (a "block", planned statically by `blocks_between`) is
one of: the diagonal (same chunk: causal mask), a full block (keys before the queries) or nothing (keys
after them). Blocks are computed by the block kernels of kernels.dispatch, each returning its output and
log-sum-exp; outputs are merged by their log-sum-exp in fp32. Backward recomputes each block's
probabilities from the merged lse, so the blocks' gradients simply add up. What attention keeps for
backward is what flash attention keeps: q, k, v, the output and the lse of this rank's positions.
Attention dropout draws one seed per block from the current stream (the TP stream, seeded per TP and
CP rank); backward redraws the block's mask from it, and recomputation replays the same seeds.

`counting()` counts the attention FLOPs this process computes, for the balance test and benchmarks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from engine.attention_mask import AttentionMask
from engine.parallel import comm
from engine.parallel.context_split import chunk_ids
from kernels import dispatch

COMM_TYPES = ("p2p", "all_gather")


@dataclass(frozen=True)
class Block:
    """Queries of local chunk `q` (0 or 1) against keys of the K/V owner's chunk `k` (0 or 1)."""
    q: int
    k: int
    causal: bool  # the diagonal block: same positions, causal mask


def blocks_between(cp: int, q_rank: int, kv_rank: int) -> list:
    """The blocks CP rank `q_rank` computes with the keys and values of CP rank `kv_rank`.

    With the load-balanced layout: its own K/V give the two diagonals and one full block; an earlier
    rank's give its first chunk against both query chunks, a later rank's both its chunks against the
    second query chunk: two full blocks either way, so every ring step costs every rank the same.
    """
    blocks = []
    for qi, q_chunk in enumerate(chunk_ids(cp, q_rank)):
        for ki, k_chunk in enumerate(chunk_ids(cp, kv_rank)):
            if k_chunk <= q_chunk:
                blocks.append(Block(qi, ki, causal=k_chunk == q_chunk))
    return blocks


def ring_order(cp: int, cp_rank: int) -> list:
    """Whose K/V a rank holds at each step: its own, then its ring predecessors'."""
    return [(cp_rank - i) % cp for i in range(cp)]


@dataclass
class FlopCounter:
    forward: float = 0.0
    backward: float = 0.0


_counter: Optional[FlopCounter] = None


@contextlib.contextmanager
def counting() -> Iterator[FlopCounter]:
    """Count the attention FLOPs computed by the blocks inside the block (forward and backward)."""
    global _counter
    previous, _counter = _counter, FlopCounter()
    try:
        yield _counter
    finally:
        _counter = previous


def _count(q: torch.Tensor, k: torch.Tensor, block: Block, backward: bool) -> None:
    if _counter is None:
        return
    b, sq, nq, d = q.shape
    pairs = sq * (sq + 1) / 2 if block.causal else sq * k.shape[1]
    flops = 4.0 * b * nq * d * pairs  # QK^T and PV, two flops per multiply-add
    if backward:
        _counter.backward += 2.5 * flops  # QK^T again, dV, dP, dQ, dK
    else:
        _counter.forward += flops


def _merge(acc: Optional[tuple], out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """Two partial softmax-attention results of the same queries, combined by their log-sum-exp."""
    out = out.to(torch.promote_types(out.dtype, torch.float32))
    lse = lse.to(out.dtype)
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    weight = lambda part: (part - new_lse).exp().transpose(1, 2).unsqueeze(-1)  # noqa: E731 - [b, s, nq, 1]
    return acc_out * weight(acc_lse) + out * weight(lse), new_lse


class ContextAttention:
    """Causal attention of one layer over the CP group of `ctx`: `attn(q, k, v, mask, dropout_p)` with q, k, v
    [b, s_local, heads, d] of this rank's two chunks; returns [b, s_local, nq, d]."""

    def __init__(self, ctx, block_backend: str):
        self.cp, self.rank = ctx.cp_size, ctx.cp_rank
        self.group, self.ranks, self.comm_type = ctx.cp_group, ctx.cp_ranks, ctx.cp_comm_type
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.comm_type!r}: choose one of {', '.join(COMM_TYPES)}")
        self.block_forward, self.block_backward = dispatch.attention_block_fns(block_backend)
        self.steps = [(owner, blocks_between(self.cp, self.rank, owner)) for owner in ring_order(self.cp, self.rank)]

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
        if not mask.causal:
            raise ValueError("context-parallel attention plans its blocks for a causal mask")
        seeds = None
        if dropout_p > 0.0:
            n = sum(len(blocks) for _, blocks in self.steps)
            seeds = torch.randint(0, 2 ** 62, (n,), device=q.device).tolist()
        return _ContextAttentionFn.apply(q, k, v, self, dropout_p, seeds)

    # ------------------------------------------------------------------ moving K/V
    def _shift(self, send: list, recv: list) -> list:
        """Post the sends to the next ring rank and the receives from the previous one; returns the works."""
        nxt, prev = self.ranks[(self.rank + 1) % self.cp], self.ranks[(self.rank - 1) % self.cp]
        ops = [comm.send_op(t, nxt, self.group) for t in send] + [comm.recv_op(t, prev, self.group) for t in recv]
        return comm.batch_isend_irecv(ops)

    def _gather(self, kv: torch.Tensor) -> torch.Tensor:
        full = kv.new_empty((self.cp * kv.shape[0],) + tuple(kv.shape[1:]))
        comm.all_gather_into(full, kv, group=self.group)
        return full.view((self.cp,) + tuple(kv.shape))

    def _kv_steps(self, kv: torch.Tensor):
        """(step, owner, blocks, owner's K/V) for the ring steps; ring transfers overlap the caller's work."""
        if self.comm_type == "all_gather":
            full = self._gather(kv)
            for step, (owner, blocks) in enumerate(self.steps):
                yield step, owner, blocks, full[owner]
            return
        for step, (owner, blocks) in enumerate(self.steps):
            works, nxt = [], None
            if step < self.cp - 1:
                nxt = torch.empty_like(kv)
                works = self._shift([kv], [nxt])
            yield step, owner, blocks, kv
            for work in works:
                work.wait()
            kv = nxt

    # ------------------------------------------------------------------ forward and backward
    def forward(self, q, k, v, dropout_p: float, seeds) -> tuple:
        c = q.shape[1] // 2
        halves, acc, n = (q[:, :c], q[:, c:]), [None, None], 0
        for _, _, blocks, kv in self._kv_steps(torch.stack((k, v))):
            for blk in blocks:
                kk, vv = (t[:, blk.k * c:(blk.k + 1) * c] for t in kv)
                out, lse = self.block_forward(halves[blk.q], kk, vv, blk.causal, None, dropout_p,
                                              seeds[n] if seeds else None)
                _count(halves[blk.q], kk, blk, backward=False)
                acc[blk.q] = _merge(acc[blk.q], out, lse)
                n += 1
        return torch.cat((acc[0][0], acc[1][0]), dim=1).to(q.dtype), torch.cat((acc[0][1], acc[1][1]), dim=2)

    def _block_grads(self, dq, dkv, kv, blocks, saved, c, dropout_p, seeds, n) -> int:
        """Add the gradients of one step's blocks to dq and to the owner's dK/dV; returns the next seed index."""
        do, q, out, lse = saved
        for blk in blocks:
            qs, ks = slice(blk.q * c, (blk.q + 1) * c), slice(blk.k * c, (blk.k + 1) * c)
            kk, vv = kv[0][:, ks], kv[1][:, ks]
            grads = self.block_backward(do[:, qs], q[:, qs], kk, vv, out[:, qs], lse[..., qs], blk.causal, None,
                                        dropout_p, seeds[n] if seeds else None)
            _count(q[:, qs], kk, blk, backward=True)
            dq[:, qs] += grads[0]
            dkv[0][:, ks] += grads[1]
            dkv[1][:, ks] += grads[2]
            n += 1
        return n

    def backward(self, do, q, k, v, out, lse, dropout_p: float, seeds) -> tuple:
        c, wide = q.shape[1] // 2, torch.promote_types(q.dtype, torch.float32)
        kv, saved, n = torch.stack((k, v)), (do, q, out, lse), 0
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        if self.comm_type == "all_gather":
            full = self._gather(kv)
            dkv_all = torch.zeros(full.shape, dtype=wide, device=q.device)
            for owner, blocks in self.steps:
                n = self._block_grads(dq, dkv_all[owner], full[owner], blocks, saved, c, dropout_p, seeds, n)
            dkv = torch.empty(kv.shape, dtype=wide, device=q.device)
            comm.reduce_scatter_into(dkv, dkv_all.view((-1,) + tuple(kv.shape[1:])), group=self.group)
        else:
            # dK/dV travel with the K/V they belong to, gathering each holder's part; one more hop home.
            dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)
            for step, (owner, blocks) in enumerate(self.steps):
                last = step == self.cp - 1
                next_kv = None if last else torch.empty_like(kv)
                kv_works = [] if last else self._shift([kv], [next_kv])
                n = self._block_grads(dq, dkv, kv, blocks, saved, c, dropout_p, seeds, n)
                next_dkv = torch.empty_like(dkv)
                for work in kv_works + self._shift([dkv], [next_dkv]):
                    work.wait()
                kv, dkv = next_kv, next_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ContextAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn: ContextAttention, dropout_p: float, seeds):
        out, lse = attn.forward(q, k, v, dropout_p, seeds)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn, ctx.dropout_p, ctx.seeds = attn, dropout_p, seeds
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.attn.backward(do, q, k, v, out, lse, ctx.dropout_p, ctx.seeds)
        return dq, dk, dv, None, None, None

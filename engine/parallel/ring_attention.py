"""Attention over a context-parallel group: every query sees exactly the keys its mask lets it see.

Each CP rank holds two chunks of every sequence (engine/parallel/context_split.py) and their q, k and v.
The keys and values of the other ranks reach it in one of two ways (`--cp-comm-type`):
- p2p: round a ring. At step i a rank holds the K/V of rank (r - i) mod cp, sends it on to r + i' - i for
  the next step i' and receives the next from r - (i' - i), one batched isend/irecv per step posted before
  the step's attention, so the transfer overlaps the compute. Every rank posts the same operations in the
  same order, which is deadlock-free under nccl's rules. Backward passes K/V round again, and with them the
  dK/dV accumulated so far for their owner; after the last step each dK/dV goes home.
- all_gather: K/V gathered once (as Llama 3 trained), dK/dV reduce-scattered back in backward.
Both visit the owners in the same order, so their forward results are identical.

The work between a query chunk and a key chunk (a "block") is planned from the chunks' absolute positions
by the mask (engine/attention_mask.py): a block is computed when some query of it sees some key of it, and
the block kernels of kernels.dispatch mask the rest from the same positions. Under a causal mask that is
the diagonal blocks and the keys before the queries; a sliding window drops the blocks wholly behind it,
packed documents the blocks whose keys share no document with their queries (in any sample of the microbatch:
every rank holds the whole microbatch's documents, so all plan alike), and a ring step at which no rank has a
block is skipped (`plan`): the K/V hop straight past it. Blocks return their output and log-sum-exp; outputs are merged by their log-sum-exp in fp32 (a row that sees no
key of a block adds nothing). Backward recomputes each block's probabilities from the merged lse, so the
blocks' gradients simply add up. What attention keeps for backward is what flash attention keeps: q, k,
v, the output and the lse of this rank's positions. Attention dropout draws one seed per block from the
current stream (the TP stream, seeded per TP and CP rank); backward redraws the block's mask from it,
and recomputation replays the same seeds.

`counting()` counts the attention FLOPs this process computes (the visible query-key pairs of each block)
and the ring steps at which it computed anything, for the tests and benchmarks.
"""
from __future__ import annotations

import contextlib
import functools
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
    queries: range  # the positions of the queries and of the keys in the whole sequence
    keys: range
    pairs: int      # the visible (query, key) pairs of the microbatch's samples: the work the FLOP counter counts


def blocks_between(cp: int, q_rank: int, kv_rank: int, chunk: int, mask: AttentionMask, samples: int = 1) -> list:
    """The blocks CP rank `q_rank` computes with the keys and values of CP rank `kv_rank`, `chunk` positions each.

    Under a causal mask with the load-balanced layout: its own K/V give the two diagonals and one full block;
    an earlier rank's give its first chunk against both query chunks, a later rank's both its chunks against
    the second query chunk: two full blocks either way, so every ring step costs every rank the same. Packed
    documents break that balance: a block's work is its visible pairs, which depend on where documents begin.
    """
    blocks, span = [], lambda i: range(i * chunk, (i + 1) * chunk)  # noqa: E731 - a chunk's positions
    for qi, q_chunk in enumerate(chunk_ids(cp, q_rank)):
        for ki, k_chunk in enumerate(chunk_ids(cp, kv_rank)):
            queries, keys = span(q_chunk), span(k_chunk)
            if mask.sees_any(queries, keys):
                blocks.append(Block(qi, ki, queries, keys, mask.pairs(queries, keys, samples)))
    return blocks


def ring_order(cp: int, cp_rank: int) -> list:
    """Whose K/V a rank holds at each step of the whole ring: its own, then its ring predecessors'."""
    return [(cp_rank - i) % cp for i in range(cp)]


def _steps(cp: int, cp_rank: int, chunk: int, mask: AttentionMask, samples: int) -> tuple:
    between = functools.partial(blocks_between, cp, chunk=chunk, mask=mask, samples=samples)
    offsets = [i for i in range(cp) if any(between(r, (r - i) % cp) for r in range(cp))]
    return tuple((i, (cp_rank - i) % cp, between(cp_rank, (cp_rank - i) % cp)) for i in offsets)


_layer_steps = functools.lru_cache(maxsize=None)(_steps)  # a layer's mask without documents: a few per run


def plan(cp: int, cp_rank: int, chunk: int, mask: AttentionMask, samples: int = 1) -> tuple:
    """(offset, owner, blocks) of the ring steps rank `cp_rank` takes: the steps of `ring_order` at which some
    rank of the group has a block (the same offsets on every rank, so all post the same transfers); the
    owner is rank (cp_rank - offset) mod cp, and `blocks` may be empty for this rank (it only passes K/V on).
    A microbatch's packed documents keep the plans made for them (one per distinct layer mask), and no longer."""
    if mask.documents is None:
        return _layer_steps(cp, cp_rank, chunk, mask, samples)
    key = (cp, cp_rank, chunk, mask.causal, mask.window)
    if key not in mask.documents.plans:
        mask.documents.plans[key] = _steps(cp, cp_rank, chunk, mask, samples)
    return mask.documents.plans[key]


@dataclass
class FlopCounter:
    forward: float = 0.0
    backward: float = 0.0
    steps: int = 0  # forward ring steps at which this rank computed a block


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


def _count(q: torch.Tensor, block: Block, backward: bool) -> None:
    if _counter is None:
        return
    flops = 4.0 * q.shape[2] * q.shape[3] * block.pairs  # QK^T and PV, two flops per multiply-add
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
    base = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows no key was seen by yet: both weights 0
    weight = lambda part: (part - base).exp().transpose(1, 2).unsqueeze(-1)  # noqa: E731 - [b, s, nq, 1]
    return acc_out * weight(acc_lse) + out * weight(lse), new_lse


@dataclass(frozen=True)
class _Pass:
    """What one call's forward and backward share: the mask, the ring steps planned for it, dropout."""
    mask: AttentionMask
    steps: tuple
    dropout_p: float
    seeds: Optional[list]
    softmax_scale: Optional[float] = None  # None: 1/sqrt(head channels)

    def block_args(self, blk: Block, n: int) -> dict:
        """The block kernels' keyword arguments for block `blk`, the call's `n`-th."""
        return dict(softmax_scale=self.softmax_scale, dropout_p=self.dropout_p,
                    seed=self.seeds[n] if self.seeds else None,
                    window=self.mask.window, q_offset=blk.queries[0], k_offset=blk.keys[0],
                    doc_bounds=self.mask.bounds)


class ContextAttention:
    """Attention of one layer over the CP group of `ctx`: `attn(q, k, v, mask, dropout_p)` with q, k, v
    [b, s_local, heads, d] of this rank's two chunks; returns [b, s_local, nq, d]."""

    def __init__(self, ctx, block_backend: str):
        self.cp, self.rank = ctx.cp_size, ctx.cp_rank
        self.group, self.ranks, self.comm_type = ctx.cp_group, ctx.cp_ranks, ctx.cp_comm_type
        if self.comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.comm_type!r}: choose one of {', '.join(COMM_TYPES)}")
        self.block_forward, self.block_backward = dispatch.attention_block_fns(block_backend)

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0, softmax_scale=None):
        steps = plan(self.cp, self.rank, q.shape[1] // 2, mask, q.shape[0])
        seeds = None
        if dropout_p > 0.0:
            n = sum(len(blocks) for _, _, blocks in steps)
            seeds = torch.randint(0, 2 ** 62, (n,), device=q.device).tolist()
        return _ContextAttentionFn.apply(q, k, v, self, _Pass(mask, steps, dropout_p, seeds, softmax_scale))

    # ------------------------------------------------------------------ moving K/V
    def _shift(self, send: list, recv: list, hop: int) -> list:
        """Post the sends to the rank `hop` ahead on the ring and the receives from the one `hop` behind."""
        nxt, prev = self.ranks[(self.rank + hop) % self.cp], self.ranks[(self.rank - hop) % self.cp]
        ops = [comm.send_op(t, nxt, self.group) for t in send] + [comm.recv_op(t, prev, self.group) for t in recv]
        return comm.batch_isend_irecv(ops)

    def _gather(self, kv: torch.Tensor) -> torch.Tensor:
        full = kv.new_empty((self.cp * kv.shape[0],) + tuple(kv.shape[1:]))
        comm.all_gather_into(full, kv, group=self.group)
        return full.view((self.cp,) + tuple(kv.shape))

    def _hops(self, steps: tuple) -> list:
        """How far the K/V (and dK/dV) move after each step: to the next step's offset, the last home."""
        offsets = [offset for offset, _, _ in steps] + [self.cp]
        return [b - a for a, b in zip(offsets, offsets[1:])]

    def _kv_steps(self, kv: torch.Tensor, steps: tuple):
        """(owner, blocks, owner's K/V) for the ring steps; ring transfers overlap the caller's work."""
        if self.comm_type == "all_gather":
            full = self._gather(kv)
            for _, owner, blocks in steps:
                yield owner, blocks, full[owner]
            return
        for t, ((_, owner, blocks), hop) in enumerate(zip(steps, self._hops(steps))):
            works, nxt = [], None
            if t < len(steps) - 1:
                nxt = torch.empty_like(kv)
                works = self._shift([kv], [nxt], hop)
            yield owner, blocks, kv
            for work in works:
                work.wait()
            kv = nxt

    # ------------------------------------------------------------------ forward and backward
    def forward(self, q, k, v, run: _Pass) -> tuple:
        c = q.shape[1] // 2
        halves, acc, n = (q[:, :c], q[:, c:]), [None, None], 0
        for _, blocks, kv in self._kv_steps(torch.stack((k, v)), run.steps):
            for blk in blocks:
                kk, vv = (t[:, blk.k * c:(blk.k + 1) * c] for t in kv)
                out, lse = self.block_forward(halves[blk.q], kk, vv, run.mask.causal, **run.block_args(blk, n))
                _count(halves[blk.q], blk, backward=False)
                acc[blk.q] = _merge(acc[blk.q], out, lse)
                n += 1
            if blocks and _counter is not None:
                _counter.steps += 1
        return torch.cat((acc[0][0], acc[1][0]), dim=1).to(q.dtype), torch.cat((acc[0][1], acc[1][1]), dim=2)

    def _block_grads(self, dq, dkv, kv, blocks, saved, run: _Pass, n: int) -> int:
        """Add the gradients of one step's blocks to dq and to the owner's dK/dV; returns the next block index."""
        do, q, out, lse = saved
        c = q.shape[1] // 2
        for blk in blocks:
            qs, ks = slice(blk.q * c, (blk.q + 1) * c), slice(blk.k * c, (blk.k + 1) * c)
            kk, vv = kv[0][:, ks], kv[1][:, ks]
            grads = self.block_backward(do[:, qs], q[:, qs], kk, vv, out[:, qs], lse[..., qs], run.mask.causal,
                                        **run.block_args(blk, n))
            _count(q[:, qs], blk, backward=True)
            dq[:, qs] += grads[0]
            dkv[0][:, ks] += grads[1]
            dkv[1][:, ks] += grads[2]
            n += 1
        return n

    def backward(self, do, q, k, v, out, lse, run: _Pass) -> tuple:
        wide = torch.promote_types(q.dtype, torch.float32)
        kv, saved, n = torch.stack((k, v)), (do, q, out, lse), 0
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        if self.comm_type == "all_gather":
            full = self._gather(kv)
            dkv_all = torch.zeros(full.shape, dtype=wide, device=q.device)
            for _, owner, blocks in run.steps:
                n = self._block_grads(dq, dkv_all[owner], full[owner], blocks, saved, run, n)
            dkv = torch.empty(kv.shape, dtype=wide, device=q.device)
            comm.reduce_scatter_into(dkv, dkv_all.view((-1,) + tuple(kv.shape[1:])), group=self.group)
        else:
            # dK/dV travel with the K/V they belong to, gathering each holder's part; the last hop is home.
            dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)
            for t, ((_, _, blocks), hop) in enumerate(zip(run.steps, self._hops(run.steps))):
                more = t < len(run.steps) - 1
                next_kv = torch.empty_like(kv) if more else None
                kv_works = self._shift([kv], [next_kv], hop) if more else []
                n = self._block_grads(dq, dkv, kv, blocks, saved, run, n)
                next_dkv = torch.empty_like(dkv)
                for work in kv_works + self._shift([dkv], [next_dkv], hop):
                    work.wait()
                kv, dkv = next_kv, next_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ContextAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn: ContextAttention, run: _Pass):
        out, lse = attn.forward(q, k, v, run)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn, ctx.run = attn, run
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.attn.backward(do, q, k, v, out, lse, ctx.run)
        return dq, dk, dv, None, None

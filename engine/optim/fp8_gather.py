"""`--fp8-param-gather` under ZeRO-1/2 (`optim`, `optim_grads`): the distributed optimizer's all-gather moves the
weights of FP8 linears and routed experts as their FP8 codes, one byte an element, instead of the run's precision.

The codes are those the layer would make itself (engine/optim/fp8_codes.py: a linear's one scale under tensorwise
and delayed scaling, the experts' one scale per expert). A weight's scale depends on the whole weight (or
expert) only through its amax, and MAX is exact, so a shard quantized with the whole weight's scale gives the
whole weight's codes: `prepare` takes each FP8 weight's amax (an expert weight's per expert) over this rank's
shard, reduces the vector of them with MAX over the replicas (one all-reduce per buffer: the dense weights', and
the experts' over their own replicas) and, where current scaling reduces a linear's amax over tp x cp, over
those ranks too (one more); the scale is then known on every rank (a delayed scale is the history's, the same
everywhere). Each replica quantizes its own elements and the bucket's all-gather carries them: per replica one
payload of bytes, its elements of other parameters (norms, embeddings, the output layer, the router) in the
run's precision first, then its FP8 codes, padded to the longest replica's payload. The grad buffer's buckets
and shards are not changed (so the gradients, their norm and every update are the same as without the flag, bit
for bit); a bucket holding FP8 weights only moves one byte an element, one that mixes them with other parameters
up to its longest replica's payload. `land` unpacks the others' payloads and hands each layer its codes
(Fp8Linear.gathered, Fp8Experts.gathered).

What the parameters hold: the parameters of non-FP8 layers, and this rank's shard of every FP8 weight, are
current after a step as without the flag; the other replicas' elements of the FP8 weights are not gathered on
the hot path (forward and backward read only the codes) and stay as they were, `stale` saying so. Whatever
reads the weights outside forward calls Optimizer.wait_weights (checkpoint save and load through full_weights,
the end of training), which gathers those buckets once more in the run's precision (`refreshed` then marks the
codes' weights whole): a checkpoint holds the same weights as without the flag. The codes take one byte per
element of the FP8 weights beside them, and each bucket's payloads stay allocated between steps.

The payload plan and the shared amaxes and scales are functions that ZeRO-3's unit gathers (fp8_shard.py) use
too, with the same per-weight coders (fp8_codes.py) for the encoding and the hand-over.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel import comm


@dataclass
class _Piece:
    """Elements [lo, hi) of `param` (flat) in one replica's slice of a bucket, at byte `at` of its payload."""
    param: torch.nn.Parameter
    lo: int
    hi: int
    coder: object  # how its FP8 codes are made (fp8_codes), or None: moved in the run's precision
    at: int = 0


def plan(buffer, bucket, coders: dict) -> tuple:
    """(the pieces of each replica's payload of `bucket`, the payload's bytes, padded alike for every replica):
    per replica its elements of the other parameters in the run's precision first (aligned), then its codes."""
    pieces, longest = [], 0
    size = bucket.params[0].element_size()
    for r in range(buffer.replicas):
        mine = [_Piece(p, *rng, coders.get(id(p))) for p in bucket.params
                if (rng := buffer.local_range(p, r)) is not None]
        at = 0
        for piece in sorted(mine, key=lambda q: q.coder is not None):
            piece.at = at
            at += (piece.hi - piece.lo) * (1 if piece.coder is not None else size)
        pieces.append(mine)
        longest = max(longest, at)
    return pieces, -(-longest // size) * size


def field(payload: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The bytes of `piece` in one replica's payload, as codes or as the parameter's dtype."""
    n, p = piece.hi - piece.lo, piece.param
    if piece.coder is not None:
        return payload[piece.at:piece.at + n]
    return payload[piece.at:piece.at + n * p.element_size()].view(p.dtype)


def shared_scales(buffer, weights: list, shards: list, coders: dict) -> list:
    """Per FP8 weight of `buffer` (`shards`: (this rank's elements of each, maybe none; the first one's place in
    the weight)), (its amax(es) now, its scale(s)): the shards' amaxes MAX-reduced over the replicas in one
    all-reduce and, where current scaling reduces a linear's amax over tp x cp, over those ranks in one more (an
    expert's amax, whole on every tp rank, is unchanged by it)."""
    now = torch.cat([coders[id(p)].amaxes(shard, lo) for p, (shard, lo) in zip(weights, shards)])
    if buffer.replicas > 1:
        comm.all_reduce(now, buffer.group, op=comm.ReduceOp.MAX)
    group = next((coders[id(p)].group for p in weights if coders[id(p)].group is not None), None)
    if group is not None:
        comm.all_reduce(now, group, op=comm.ReduceOp.MAX)  # current scaling: the amax of the whole weight
    out, at = [], 0
    for p in weights:
        coder = coders[id(p)]
        a = now[at:at + coder.count]
        out.append((a, coder.scales(a)))
        at += coder.count
    return out


class Fp8Gather:
    def __init__(self, buffers: list, coders: dict, ctx):
        """`coders`: fp8_codes.fp8_weights of the model; `buffers`: the optimizer's grad buffers (sharded)."""
        self.buffers, self.coders, self.ctx = buffers, coders, ctx
        self.codes = {id(p): torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
                      for b in buffers for p in b.params if id(p) in coders}
        self._plans = {(i, b.index): plan(buffer, b, coders) for i, buffer in enumerate(buffers)
                       for b in buffer.buckets if any(id(p) in coders for p in b.params)}
        self._payloads = {}  # (buffer index, bucket index) -> the bucket's gathered payloads
        self._now = {}     # id(weight) -> its amax(es) now, what a linear notes (set by prepare)
        self._scale = {}   # id(weight) -> its scale(s)
        self.stale = False  # the FP8 weights' elements of other replicas are not current

    def covers(self, i: int, bucket) -> bool:
        """Whether bucket `bucket` of buffer `i` holds FP8 weights (its gather is this module's)."""
        return (i, bucket.index) in self._plans

    def prepare(self) -> None:
        """After this rank's shards are written: every FP8 weight's amax and scale, and this rank's codes."""
        for buffer in self.buffers:
            weights = [p for p in buffer.params if id(p) in self.coders]
            if weights:
                self._prepare(buffer, weights)

    def _prepare(self, buffer, weights: list) -> None:
        local = [buffer.local_range(p) or (0, 0) for p in weights]
        shards = [(p.detach().view(-1)[lo:hi], lo) for p, (lo, hi) in zip(weights, local)]
        for p, (lo, hi), (shard, _), (a, scale) in zip(weights, local, shards,
                                                       shared_scales(buffer, weights, shards, self.coders)):
            self._now[id(p)], self._scale[id(p)] = a, scale
            if hi > lo:
                self.codes[id(p)][lo:hi].copy_(self.coders[id(p)].encode(shard, lo, scale))

    def launch(self, i: int, bucket, async_op: bool):
        """Start the all-gather of bucket `bucket` of buffer `i` (this rank's payload packed); its work or None."""
        buffer, (pieces, size) = self.buffers[i], self._plans[(i, bucket.index)]
        payload = self._payload(i, bucket, size)
        mine = payload[buffer.replica_rank * size:(buffer.replica_rank + 1) * size]
        for piece in pieces[buffer.replica_rank]:
            field(mine, piece).copy_(self._source(piece))
        if buffer.replicas == 1:
            return None
        return comm.all_gather_into(payload, mine, group=buffer.group, async_op=async_op)

    def _payload(self, i: int, bucket, size: int) -> torch.Tensor:
        key = (i, bucket.index)
        if key not in self._payloads:
            self._payloads[key] = torch.zeros(size * self.buffers[i].replicas, dtype=torch.uint8,
                                              device=self.buffers[i].device)
        return self._payloads[key]

    def _source(self, piece: _Piece) -> torch.Tensor:
        """Where `piece`'s elements live here: the weight's codes, or the parameter itself."""
        if piece.coder is not None:
            return self.codes[id(piece.param)][piece.lo:piece.hi]
        return piece.param.detach().view(-1)[piece.lo:piece.hi]

    def land(self, i: int, bucket) -> None:
        """After the all-gather: the other replicas' elements into place, and each layer of the bucket its codes."""
        buffer, (pieces, size) = self.buffers[i], self._plans[(i, bucket.index)]
        payload = self._payload(i, bucket, size)
        for r in range(buffer.replicas):
            if r != buffer.replica_rank:
                for piece in pieces[r]:
                    self._source(piece).copy_(field(payload[r * size:(r + 1) * size], piece))
        for p in bucket.params:
            coder = self.coders.get(id(p))
            if coder is not None:
                coder.hand_over(p, self.codes[id(p)], self._now[id(p)], self._scale[id(p)], coder.steps,
                                whole=buffer.replicas == 1)
        self.stale = self.stale or buffer.replicas > 1

    def stale_buckets(self) -> list:
        """(buffer index, bucket) of the gathers whose FP8 weights are current on this rank's shard only."""
        return [(i, b) for i, buffer in enumerate(self.buffers) for b in buffer.buckets
                if self.covers(i, b) and buffer.replicas > 1] if self.stale else []

    def refreshed(self, held: list) -> None:
        """The weights were gathered whole in the run's precision: codes that held before (`held`, from `holding`)
        still do, their weights whole."""
        for p, coder in held:
            coder.refreshed(p)
        self.stale = False

    def holding(self) -> list:
        """(weight, its coder) whose gathered codes hold now."""
        return [(p, self.coders[id(p)]) for b in self.buffers for p in b.params
                if id(p) in self.coders and self.coders[id(p)].holds(p)]


"""Who orthogonalises which matrix under Muon, and how its momentum gets there and its update back.

Muon's update of a weight needs the whole matrix (the Newton-Schulz iteration mixes all its elements), but
the step's inputs are spread: tensor parallelism splits a weight over the tp ranks, and the distributed
optimizer (ZeRO-1/2/3) gives each dp x cp replica a flat slice of every grad-buffer bucket, which cuts
matrices anywhere. A plan, one per grad buffer (dense weights over dp x cp, experts over dp/ep x cp), is
made once from shapes and the bucket layout alone, so every rank computes the same plan with no message:

- units: each weight marked as a hidden matrix (ParamSpec.matrix) is one unit, a routed expert stack one unit
  per expert (engine/optim/newton_schulz.py says which matrices a unit holds);
- ownership: under the distributed optimizer each unit is owned by one replica, which orthogonalises it;
  units are dealt largest first (by Newton-Schulz FLOPs), each to the replica already holding most of it
  (fewer bytes to move) among those that leave the busiest replica no busier than the least loaded one would
  (`deal`). Without sharding every replica holds every element and orthogonalises everything itself, as it
  updates everything;
- tensor parallelism (`--muon-tp-mode`): blockwise orthogonalises each tp shard as it is (the update depends
  on tp); duplicated all-gathers the unit's shards over tp and every tp rank orthogonalises the whole matrix
  and keeps its slice; distributed deals whole matrices to tp ranks (in the same balancing) and the owner
  scatters the slices back. Experts are not split over tp: every tp rank orthogonalises its own copy.

A step (`run`), per buffer: the look-ahead momentum of this rank's range goes to the units' owners (one
all_to_all over the replicas: each element travels once, and not at all when its holder owns the unit), the
owners gather over tp where the mode asks (all-gather, or all_to_all to the owning tp rank), orthogonalise,
and the updates come back the same ways. `bytes_sent` is what this rank sends per step, as comm.counting()
counts it; `flops` the Newton-Schulz work it does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from engine.optim.newton_schulz import matrix_shapes, newton_schulz_flops, orthogonalize
from engine.parallel import comm
from engine.parallel.layers import spec_of

FP32 = 4


@dataclass(eq=False)
class Unit:
    """One weight, or one expert of a stack, as this rank's tp shard holds it: flat elements [lo, hi)."""
    param: torch.nn.Parameter
    lo: int
    hi: int
    shape: tuple                     # the shard's shape: the parameter's own, or one expert's [in, out]
    whole: bool                      # gathered over tp and orthogonalised as the whole matrix
    flops: int                       # Newton-Schulz FLOPs of what its owner orthogonalises
    pieces: Optional[tuple] = None   # sharded buffers: per replica, the (start, end) of [lo, hi) it holds, or None
    dp_owner: Optional[int] = None   # the replica that orthogonalises it; None: every replica, its own copy
    tp_owner: Optional[int] = None   # the tp rank that orthogonalises it (distributed); None: every tp rank

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def spec(self):
        return spec_of(self.param)


def _overlap(a: tuple, b) -> Optional[tuple]:
    if b is None:
        return None
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else None


def _size(piece) -> int:
    return piece[1] - piece[0] if piece else 0


def deal(units: list, replicas: int, tp: int, spread: bool) -> None:
    """Set each unit's owners, largest first (FLOPs): among the (replica, tp rank) choices that leave the busiest
    no busier than the least loaded choice would (or than it already is), the replica holding most of the unit
    (fewest bytes to move), then the least loaded, then the lowest. Loads count per tp rank: a unit that every tp
    rank orthogonalises loads all of them."""
    load = [[0] * tp for _ in range(replicas)]
    for u in sorted(units, key=lambda u: -u.flops):  # stable: equal units keep the buffer's order
        ranks = range(tp) if spread and u.whole else [None]
        choices = [(d, t) for d in range(replicas) for t in ranks]

        def after(dt):
            d, t = dt
            return (load[d][t] if t is not None else max(load[d])) + u.flops
        bound = max(min(after(dt) for dt in choices), max(max(row) for row in load))
        d, t = min((dt for dt in choices if after(dt) <= bound),
                   key=lambda dt: (-_size(u.pieces[dt[0]]) if u.pieces else 0, after(dt), dt[0], dt[1] or 0))
        for k in ([t] if t is not None else range(tp)):
            load[d][k] += u.flops
        u.dp_owner, u.tp_owner = (d if u.pieces else None), t


class MuonPlan:
    def __init__(self, buffer, ctx, settings):
        """The plan of one grad buffer (module docstring); `settings`: newton_schulz.MuonSettings."""
        self.buffer, self.settings = buffer, settings
        self.sharded = buffer.distributed and buffer.replicas > 1
        self.n, self.me = (buffer.replicas, buffer.replica_rank) if self.sharded else (1, 0)
        self.tp, self.tp_rank, self.tp_group = ctx.tp_size, ctx.tp_rank, ctx.tp_group
        self.units = [u for p in buffer.params if spec_of(p).matrix for u in self._units_of(p)]
        deal(self.units, self.n, self.tp, settings.spread_over_tp)
        self.here = [u for u in self.units if u.dp_owner in (None, self.me)]  # this replica gathers them
        self.whole = [u for u in self.here if u.whole]
        self.computed = [u for u in self.here if u.tp_owner in (None, self.tp_rank)]
        self.cross_dp = any(_size(u.pieces[r]) for u in self.units if u.pieces for r in range(self.n)
                            if r != u.dp_owner)

    def _units_of(self, p) -> list:
        spec, split, steps = spec_of(p), self.settings.split_qkv, len(self.settings.coefficients)
        whole = self.settings.whole_over_tp and spec.tp_axis is not None and self.tp > 1
        if spec.matrix == "experts":
            shape = tuple(p.shape[1:])  # (ZeRO-3 weights have no storage here: shapes only)
            spans = [(e * math.prod(shape), (e + 1) * math.prod(shape)) for e in range(p.shape[0])]
        else:
            shape, spans = tuple(p.shape), [(0, p.numel())]
        flops = sum(newton_schulz_flops(o, i, steps)
                    for o, i in matrix_shapes(spec.full_shape if whole else shape, spec, split))
        out = []
        for lo, hi in spans:
            pieces = tuple(_overlap((lo, hi), self.buffer.local_range(p, r)) for r in range(self.n)) \
                if self.sharded else None
            out.append(Unit(p, lo, hi, shape, whole, flops, pieces))
        return out

    # --- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, looks: dict, updates: dict) -> None:
        """`looks`: id(param) -> (start, flat fp32 tensor) this rank's range of the look-ahead momentum;
        fills `updates` (same keys, tensors of the same ranges) with the scaled orthogonalised updates."""
        shards = self._gather_replicas(looks)
        full = self._gather_tp(shards)
        done = {u: orthogonalize(full.get(u, shards.get(u)), u.spec, self.settings) for u in self.computed}
        self._scatter_replicas(self._scatter_tp(done), updates)

    def _gather_replicas(self, looks: dict) -> dict:
        """unit -> its tp shard (its shape) for each unit this replica gathers."""
        if not self.sharded:
            return {u: looks[id(u.param)][1][u.lo:u.hi].view(u.shape) for u in self.here}
        sends = [[] for _ in range(self.n)]
        for u in self.units:
            if u.pieces[self.me]:
                sends[u.dp_owner].append(self._piece(looks, u, u.pieces[self.me]))
        sizes = [[_size(u.pieces[r]) for u in self.here if u.pieces[r]] for r in range(self.n)]
        got = self._exchange(sends, sizes, self.buffer.group, self.me, self.cross_dp)
        out, cursor = {}, [0] * self.n
        for u in self.here:
            t = torch.empty(u.numel, dtype=torch.float32, device=self.buffer.device)
            for r, piece in enumerate(u.pieces):
                if piece:
                    t[piece[0] - u.lo:piece[1] - u.lo].copy_(got[r][cursor[r]])
                    cursor[r] += 1
            out[u] = t.view(u.shape)
        return out

    def _gather_tp(self, shards: dict) -> dict:
        """unit -> the whole matrix, for the units this rank orthogonalises whole."""
        if not self.whole:
            return {}
        if not self.settings.spread_over_tp:  # duplicated: every tp rank gathers every unit
            flat = torch.cat([shards[u].reshape(-1) for u in self.whole])
            out = flat.new_empty(self.tp * flat.numel())
            comm.all_gather_into(out, flat, group=self.tp_group)
            parts, offset = out.view(self.tp, -1), 0
            whole = {}
            for u in self.whole:
                whole[u] = torch.cat([s[offset:offset + u.numel].view(u.shape) for s in parts], u.spec.tp_axis)
                offset += u.numel
            return whole
        sends = [[shards[u].reshape(-1) for u in self.whole if u.tp_owner == t] for t in range(self.tp)]
        mine = [u for u in self.whole if u.tp_owner == self.tp_rank]
        got = self._exchange(sends, [[u.numel for u in mine]] * self.tp, self.tp_group, self.tp_rank, True)
        return {u: torch.cat([got[r][k].view(u.shape) for r in range(self.tp)], u.spec.tp_axis)
                for k, u in enumerate(mine)}

    def _scatter_tp(self, done: dict) -> dict:
        """unit -> this rank's tp shard of its update (flat), for every unit this replica gathered."""
        def mine(u, t):
            o = done[u]
            return o.chunk(self.tp, u.spec.tp_axis)[t].reshape(-1) if u.whole else o.reshape(-1)
        out = {u: mine(u, self.tp_rank) for u in self.computed}
        if self.whole and self.settings.spread_over_tp:
            owned = [u for u in self.whole if u.tp_owner == self.tp_rank]
            sends = [[mine(u, t) for u in owned] for t in range(self.tp)]
            sizes = [[u.numel for u in self.whole if u.tp_owner == t] for t in range(self.tp)]
            got = self._exchange(sends, sizes, self.tp_group, self.tp_rank, True)
            for t in range(self.tp):
                for u, update in zip([u for u in self.whole if u.tp_owner == t], got[t]):
                    out[u] = update
        return out

    def _scatter_replicas(self, done: dict, updates: dict) -> None:
        if not self.sharded:
            for u in self.here:
                updates[id(u.param)][1][u.lo:u.hi].copy_(done[u])
            return
        sends = [[done[u][u.pieces[r][0] - u.lo:u.pieces[r][1] - u.lo] for u in self.here if u.pieces[r]]
                 for r in range(self.n)]
        mine = [u for u in self.units if u.pieces[self.me]]
        sizes = [[_size(u.pieces[self.me]) for u in mine if u.dp_owner == r] for r in range(self.n)]
        got = self._exchange(sends, sizes, self.buffer.group, self.me, self.cross_dp)
        cursor = [0] * self.n
        for u in mine:
            self._piece(updates, u, u.pieces[self.me]).copy_(got[u.dp_owner][cursor[u.dp_owner]])
            cursor[u.dp_owner] += 1

    @staticmethod
    def _piece(values: dict, u: Unit, piece: tuple) -> torch.Tensor:
        start, flat = values[id(u.param)]
        return flat[piece[0] - start:piece[1] - start]

    def _exchange(self, sends: list, sizes: list, group, me: int, active: bool) -> list:
        """What each rank of `group` sent this one, as lists of flat tensors split by `sizes` (rank by rank);
        `sends[r]`: the tensors for rank r, in order. This rank's own are handed over as they are; `active`
        False: no rank sends to another (the plan knows), so nothing is exchanged."""
        got = [None] * len(sends)
        got[me] = sends[me]
        if not active:
            return got
        others = [r for r in range(len(sends)) if r != me]
        inp = [t for r in others for t in sends[r]]
        inp = torch.cat(inp) if inp else torch.empty(0, device=self.buffer.device)
        in_splits = [0 if r == me else sum(t.numel() for t in sends[r]) for r in range(len(sends))]
        out_splits = [0 if r == me else sum(sizes[r]) for r in range(len(sends))]
        out = inp.new_empty(sum(out_splits))
        comm.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        pieces = out.split([n for r in others for n in sizes[r]])
        k = 0
        for r in others:
            got[r], k = list(pieces[k:k + len(sizes[r])]), k + len(sizes[r])
        return got

    # --- what it costs ------------------------------------------------------------------------------
    def flops(self) -> int:
        """Newton-Schulz FLOPs this rank runs per step."""
        return sum(u.flops for u in self.computed)

    def bytes_sent(self) -> float:
        """Bytes this rank sends per step, as engine.parallel.comm.counting() counts them."""
        sent = 0
        if self.sharded and self.cross_dp:
            sent += sum(_size(u.pieces[self.me]) for u in self.units if u.pieces[self.me] and u.dp_owner != self.me)
            sent += sum(_size(u.pieces[r]) for u in self.here for r in range(self.n) if r != self.me)
        if not self.settings.spread_over_tp:  # the all-gather: this rank's shards to the tp - 1 others
            sent += (self.tp - 1) * sum(u.numel for u in self.whole)
        else:  # its shards to each unit's owner, and as an owner the other tp ranks' slices back
            sent += sum(u.numel * (self.tp - 1 if u.tp_owner == self.tp_rank else 1) for u in self.whole)
        return float(FP32 * sent)

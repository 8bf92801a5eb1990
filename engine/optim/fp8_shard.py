"""`--fp8-param-gather` under ZeRO-3 (`optim_grads_params`): each unit gather (forward, backward, prefetch)
moves the FP8 linears' and routed experts' weights as their FP8 codes, one byte an element, instead of the run's
precision.

The codes, the payload and the scales are fp8_gather.py's (ZeRO-1/2), from the same functions and coders
(fp8_codes.py): per FP8 weight the amax of this rank's shard (per expert for the experts'), MAX-reduced over the
replicas (and over tp x cp under current scaling) in one all-reduce per buffer, gives the scale the layer would
use; each bucket's payload per replica holds its elements of the other parameters in the run's precision, then
its codes. What differs is when and where:

- `prepare` packs this rank's payload of every bucket holding FP8 weights from the persistent weight shard
  (param_shard._Slot.shard) once the shards or the scales may have moved: the sharder calls it before the first
  unit gather after an optimizer step, a checkpoint load (`changed`), or a delayed history's push (the scalers'
  step counts differ from those it packed with). Every rank of a stage meets that gather at the same point.
- `launch` all-gathers one bucket's payloads into a scratch tensor; `land` (when the gather is waited for) writes
  the other parameters' elements into the bucket's flat tensor, the codes into the bucket's code tensor, and
  hands each layer its codes (Fp8Linear.gathered, Fp8Experts.gathered). The FP8 weights' own elements of the
  flat tensor are not written: forward and backward (recomputation included) read only the codes, which hold
  while the weight's version and (a linear's) the scaler's step count do; their values are not whole (`whole`
  False), so a linear's moved scale raises instead of quantizing them (the experts' scales follow no history).
  Checkpoints gather the shards in the run's precision (ParamSharder.gathered).
- The code tensor is freed with the flat tensor when the unit is released and refilled by the next gather, so
  the operand forward saved for backward (a view of it) sees the same codes again in backward.

Memory: `_mine` (one payload per bucket) stays between steps; a gather holds the bucket's code tensor from its
landing to the unit's release, and the gathered payloads from launch to landing. `peak_bytes` is the most of
those two held at once (what engine/planner/fp8_gather.py allows for: tests/test_planner_sharding.py).
"""
from __future__ import annotations

import torch

from engine.optim.fp8_gather import field, plan, shared_scales
from engine.optim.param_shard import free
from engine.parallel import comm


class Fp8Shard:
    def __init__(self, slots: list, coders: dict):
        """`slots`: the sharder's buckets (param_shard._Slot); `coders`: fp8_codes.fp8_weights of the model."""
        self.coders = coders
        self._plans = {id(s): plan(s.buffer, s.bucket, coders) for s in slots
                       if any(id(p) in coders for p in s.bucket.params)}
        self._slots = [s for s in slots if id(s) in self._plans]
        self._mine = {id(s): torch.zeros(self._plans[id(s)][1], dtype=torch.uint8, device=s.shard.device)
                      for s in self._slots}
        self._codes, self._at = {}, {}  # id(slot) -> its code tensor; id(weight) -> its codes' offset in it
        for s in self._slots:
            at = 0
            for p in s.bucket.params:
                if id(p) in coders:
                    self._at[id(p)], at = at, at + p.numel()
            self._codes[id(s)] = torch.zeros(at, dtype=torch.uint8, device=s.shard.device)
            free(self._codes[id(s)])
        self._scales = {}  # id(weight) -> (its amax(es), its scale(s), the scaler's step count then)
        self._inflight = {}  # id(slot) -> its gathered payloads, until landed
        self._steps = None  # the scalers' step counts prepare packed with (None: pack before the next gather)
        self.held_bytes = self.peak_bytes = 0  # code tensors and gathered payloads held now, and at most

    def covers(self, slot) -> bool:
        """Whether `slot`'s bucket holds FP8 weights (its hot-path gathers are this module's)."""
        return id(slot) in self._plans

    def changed(self) -> None:
        """The shards were written (an optimizer step, a checkpoint load): pack again before the next gather."""
        self._steps = None

    def ready(self) -> None:
        """Pack the payloads if the shards or the scales moved since they were packed (see the module doc)."""
        if self._slots and self._steps != self._step_counts():
            with torch.no_grad():
                self.prepare()

    def _step_counts(self) -> list:
        return [self.coders[id(p)].steps for s in self._slots for p in s.bucket.params if id(p) in self.coders]

    def prepare(self) -> None:
        """Every FP8 weight's amax and scale (collective over each buffer's replicas), and this rank's payloads."""
        for buffer in dict.fromkeys(s.buffer for s in self._slots):
            slots = [s for s in self._slots if s.buffer is buffer]
            weights = [p for s in slots for p in s.bucket.params if id(p) in self.coders]
            shards = [(self._shard(s, p), (s.buffer.local_range(p) or (0, 0))[0])
                      for s in slots for p in s.bucket.params if id(p) in self.coders]
            for p, (now, scale) in zip(weights, shared_scales(buffer, weights, shards, self.coders)):
                self._scales[id(p)] = now, scale, self.coders[id(p)].steps
            for s in slots:
                self._pack(s)
        self._steps = self._step_counts()

    @staticmethod
    def _shard(slot, p) -> torch.Tensor:
        """This rank's elements of `p` in the slot's persistent shard (maybe none)."""
        mine = slot.buffer.local_slice(p, slot.shard)
        return mine if mine is not None else slot.shard[:0]

    def _pack(self, slot) -> None:
        mine = self._mine[id(slot)]
        for piece in self._plans[id(slot)][0][slot.buffer.replica_rank]:
            shard = self._shard(slot, piece.param)
            if piece.coder is not None:
                shard = piece.coder.encode(shard, piece.lo, self._scales[id(piece.param)][1])
            field(mine, piece).copy_(shard)

    def launch(self, slot, async_op: bool):
        """Start the all-gather of the slot's payloads (into a scratch tensor): its work, None at one replica."""
        replicas, size, mine = slot.buffer.replicas, self._plans[id(slot)][1], self._mine[id(slot)]
        if replicas == 1:
            self._inflight[id(slot)] = mine
            return None
        out = self._inflight[id(slot)] = torch.empty(replicas * size, dtype=torch.uint8, device=mine.device)
        self._hold(out.numel())
        return comm.all_gather_into(out, mine, group=slot.buffer.group, async_op=async_op)

    def land(self, slot) -> None:
        """After the all-gather: the other parameters' elements into the flat tensor, the codes into the code
        tensor, and each layer of the bucket its codes."""
        (pieces, size), codes = self._plans[id(slot)], self._codes[id(slot)]
        payload = self._inflight.pop(id(slot))
        codes.untyped_storage().resize_(codes.numel())
        self._hold(codes.numel())  # the payloads are still held
        for r, mine in enumerate(pieces):
            for piece in mine:
                if piece.coder is not None:
                    at = self._at[id(piece.param)]
                    out = codes[at + piece.lo:at + piece.hi]
                else:  # through .data, as the all-gather into the flat tensor writes: autograd's saved
                    out = piece.param.data.view(-1)[piece.lo:piece.hi]  # weights keep their versions
                out.copy_(field(payload[r * size:(r + 1) * size], piece))
        for p in slot.bucket.params:
            coder = self.coders.get(id(p))
            if coder is not None:
                now, scale, steps = self._scales[id(p)]
                coder.hand_over(p, codes[self._at[id(p)]:self._at[id(p)] + p.numel()], now, scale, steps,
                                whole=False)
        if payload is not self._mine[id(slot)]:
            self._hold(-payload.numel())

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def release(self, slot) -> None:
        """The unit is released: its codes are freed with the weights."""
        free(self._codes[id(slot)])
        self._hold(-self._codes[id(slot)].numel())

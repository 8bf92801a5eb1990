"""`--overlap-param-gather` under ZeRO-1/2 (`optim`, `optim_grads`), with Megatron-LM's meaning: the updated
weights are all-gathered over the replicas bucket by bucket while the next forward runs.

Without the flag, Optimizer._publish_sharded gathers each bucket into a scratch tensor at the end of the step
and copies it into the parameters before the step returns. With it, each bucket's parameters are made views
of one flat tensor shaped like the bucket (param_shard.flatten_bucket), so an all-gather writes the weights in
place, with no scratch and no copy. `start` copies this rank's updated masters into its slice of every bucket
and launches the asynchronous all-gathers in forward order (the grad buffer lays buckets out in reverse
forward order: last to first), one sequence per buffer and its group (dense, MoE experts); then the step
returns. Forward waits for them where it first needs them: a forward pre-hook on each unit
(param_shard.param_units: the embedding, whose module is the chunk itself, each layer, the head) waits for
the buckets holding that unit's parameters (a bucket spanning two units is waited for by the first one
entered); the chunk's own pre-hook waits for parameters in no unit, and for every bucket of a chunk that has
no units (the modules some tests build). Recomputation and evaluation pass the same hooks; once waited for, a
bucket costs them nothing.

Outside forward, `finish` waits for everything: before the next `start`, for checkpoint save and load
(Optimizer.full_weights; a gather still in flight would otherwise overwrite the loaded weights or leave
stale ones to be saved) and at the end of training. The values are those the synchronous path publishes,
bit for bit.

With `--fp8-param-gather` (`fp8`, an engine.optim.fp8_gather.Fp8Gather) a bucket holding FP8 weights is
gathered by it instead, as a payload of bytes, and unpacked (its `land`) when waited for.

`trace` (None unless set to a list) records ("launch", key), ("wait", key) and ("enter", chunk, unit) in the
order they happen, a key being (buffer, bucket index): tests/test_param_gather.py reads from it that the
gathers are in flight while forward runs.
"""
from __future__ import annotations

from typing import Optional

from engine.optim.param_shard import flatten_bucket, param_units
from engine.parallel import comm


class ParamGather:
    def __init__(self, model_chunks: list, buffers: list, fp8=None):
        """Make every bucket of `buffers` one flat tensor and hook the forward of `model_chunks`; `fp8`: the
        Fp8Gather that moves the buckets holding FP8 weights, or None."""
        self.buffers, self.fp8 = buffers, fp8
        self._flat = {(i, b.index): flatten_bucket(buffer, b) for i, buffer in enumerate(buffers)
                      for b in buffer.buckets}
        self._key = {id(p): (i, buffer.bucket_of(p).index) for i, buffer in enumerate(buffers) for p in buffer.params}
        self._pending = {}  # key -> the all-gather in flight into that bucket
        self.trace: Optional[list] = None
        for c, chunk in enumerate(model_chunks):
            self._hook(c, chunk)

    def _hook(self, c: int, chunk) -> None:
        """Forward pre-hooks: each unit waits for its buckets, the chunk for those of parameters in no unit."""
        units = param_units([chunk])[0] if hasattr(chunk, "units") else []
        covered = {id(p) for u in units for p in u.params}
        chunk.register_forward_pre_hook(self._waiter(c, "chunk", [p for p in chunk.parameters()
                                                                   if id(p) not in covered]))
        for i, unit in enumerate(units):
            unit.module.register_forward_pre_hook(self._waiter(c, i, unit.params))

    def _waiter(self, c: int, unit, params: list):
        keys = list(dict.fromkeys(self._key[id(p)] for p in params if id(p) in self._key))  # in order, each once

        def hook(module, args):
            if self.trace is not None:
                self.trace.append(("enter", c, unit))
            if self._pending:
                for key in keys:
                    self._wait(key)
        return hook

    def _wait(self, key: tuple) -> None:
        work = self._pending.pop(key, None)
        if work is not None:
            work.wait()
            bucket = self.buffers[key[0]].buckets[key[1]]
            if self.fp8 is not None and self.fp8.covers(key[0], bucket):
                self.fp8.land(key[0], bucket)
            if self.trace is not None:
                self.trace.append(("wait", key))

    def start(self, entries: list) -> None:
        """Copy the updated masters of `entries` (the optimizer's: param, start, end, master) into this rank's
        slices of the weights, then launch every bucket's all-gather without waiting."""
        self.finish()
        for e in entries:
            e.param.detach().view(-1)[e.start:e.end].copy_(e.master)
        if self.fp8 is not None:
            self.fp8.prepare()
        for i, buffer in enumerate(self.buffers):
            for bucket in reversed(buffer.buckets):  # forward order
                self._launch(i, buffer, bucket)

    def _launch(self, i: int, buffer, bucket) -> None:
        key, (lo, hi) = (i, bucket.index), buffer.shard_bounds(bucket)
        if self.fp8 is not None and self.fp8.covers(i, bucket):
            work = self.fp8.launch(i, bucket, async_op=True)
            if work is None:  # one replica: nothing to wait for
                return self.fp8.land(i, bucket)
        elif buffer.replicas == 1:
            return  # this rank's slice is the whole bucket
        else:
            flat = self._flat[key]
            work = comm.all_gather_into(flat, flat[lo:hi], group=buffer.group, async_op=True)
        self._pending[key] = work
        if self.trace is not None:
            self.trace.append(("launch", key))

    def finish(self) -> None:
        """Wait for every all-gather still in flight: the weights are whole and current after it."""
        for key in list(self._pending):
            self._wait(key)

    def padding_bytes(self) -> int:
        """Bytes the flat tensors hold beyond the parameters (each bucket padded to a multiple of the replicas)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values()) - \
            sum(p.numel() * p.element_size() for b in self.buffers for p in b.params)

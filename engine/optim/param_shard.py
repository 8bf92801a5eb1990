"""ZeRO-3 (`--data-parallel-sharding-strategy optim_grads_params`): weights stored sharded over dp, gathered
one unit at a time for forward and again for backward, freed after.

A unit is what is gathered together: the embedding (word and learned position embeddings), each transformer
layer, and the head (final norm and output weight; at pp 1 with tied embeddings the head's output weight is
the embedding's, gathered a second time). The grad buffer cuts its buckets at unit boundaries, so a unit is
a few whole buckets and gathering it is one all-gather per bucket of the bucket's shards (the same slices
the distributed optimizer owns) into a full-size flat tensor whose views are the parameters. Releasing
frees that tensor's storage; the parameters keep their shapes (nothing may read them until the next
gather) and autograd's saved references to them stay valid, seeing the weights again once re-gathered.

When, per model chunk with units u_0 .. u_k in forward order:
- forward: entering u_i (a forward pre-hook on its module) releases u_(i-1) and gathers u_i; the chunk's
  forward post-hook releases the last. On the way, a hook on u_i's input tensor is left for backward.
- backward: that hook fires when the gradient of u_i's input is complete, i.e. when u_i's backward is
  done: it releases u_i and gathers u_(i-1) (the chunk's output carries the hook that gathers u_k). At the
  end of the backward pass (an autograd engine callback) whatever backward still holds is released.
- recomputation replays a unit's forward inside its backward: a unit being back-propagated ignores its
  forward hooks, so the replay neither re-gathers nor frees it.
With `prefetch` (--overlap-param-gather) the next unit's all-gather is started asynchronously when a unit
is entered, so two units are held instead of one. Buckets are reference-counted: the tied embedding's
bucket belongs to two units.

With `--fp8-param-gather` (fp8_shard.py, `ParamSharder.fp8`) the buckets holding FP8 weights (the FP8 linears',
the routed experts') are gathered as payloads carrying those weights' FP8 codes; `gathered` (checkpoints) gathers
the shards as they are.

Gradients are not this module's business: the grad buffer reduce-scatters them (shard_grads).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from engine.parallel import comm


@dataclass
class Unit:
    module: torch.nn.Module  # whose forward pre-hook gathers it
    params: list
    buckets: list = field(default_factory=list)  # (buffer, bucket) pairs


def param_units(model_chunks: list) -> list:
    """Per chunk, its units (GPTModel.units: embedding, layers, head) in forward order, trainable parameters
    only: [[Unit, ...], ...]."""
    return [[Unit(u.module, [p for p in u.params if p.requires_grad]) for u in chunk.units()] for chunk in model_chunks]


def forward_order(chunk) -> list:
    """A model chunk's parameters in the order forward first uses them (embedding, layers, final norm, output
    weight); reversed, the order backward completes their gradients, which is how the grad buffer lays them
    out. Registration order differs: GPTModel's own parameters (positions, output weight) come first."""
    if not hasattr(chunk, "units"):
        return list(chunk.parameters())  # not a GPTModel chunk (tests build other modules)
    seen, order = set(), []
    for unit in param_units([chunk])[0]:
        for p in unit.params:
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    return order + [p for p in chunk.parameters() if id(p) not in seen]


def flatten_bucket(buffer, bucket) -> torch.Tensor:
    """One flat tensor shaped like `bucket` (padding included) whose views become its parameters, their values
    kept: an all-gather into it writes the weights in place (here, and under ZeRO-1/2 in param_gather.py)."""
    flat = torch.zeros(bucket.size, dtype=bucket.dtype, device=buffer.device)
    for p in bucket.params:
        _, off = buffer.offset_in_bucket(p)
        view = flat[off:off + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
    return flat


def free(t: torch.Tensor) -> None:
    """Release a tensor's storage; its views stay valid and see new values once it is resized and written."""
    t.untyped_storage().resize_(0)


class _Slot:
    """One bucket's weights: the persistent shard and the full tensor the parameters view, when gathered."""

    def __init__(self, buffer, bucket):
        self.buffer, self.bucket = buffer, bucket
        self.flat = flatten_bucket(buffer, bucket)
        lo, hi = buffer.shard_bounds(bucket)
        self.shard = self.flat[lo:hi].clone()
        self.holders, self.work = 0, None
        self.codes, self.landing = None, False  # the fp8_shard.Fp8Shard that gathered it; its land is due
        free(self.flat)

    def gather(self, async_op: bool, codes=None) -> None:
        """All-gather the weights (`codes`: an fp8_shard.Fp8Shard moving the FP8 weights as codes, if it covers
        this bucket)."""
        self.holders += 1
        if self.holders > 1:
            return
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        if codes is not None and codes.covers(self):
            self.codes, self.landing = codes, True
            self.work = codes.launch(self, async_op)
        elif self.buffer.replicas == 1:
            self.flat.copy_(self.shard)
        else:
            self.work = comm.all_gather_into(self.flat, self.shard, group=self.buffer.group, async_op=async_op)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.landing:
            self.landing = False
            self.codes.land(self)

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.wait()
            free(self.flat)
            if self.codes is not None:
                self.codes.release(self)
                self.codes = None


class ParamSharder:
    def __init__(self, model_chunks: list, units: list, buffers: list, *, prefetch: bool = False):
        """`units`: param_units(model_chunks), whose parameters the `buffers` hold in unit-aligned buckets."""
        self.chunks, self.prefetch = units, prefetch
        self._slots = {(id(buffer), bucket.index): _Slot(buffer, bucket) for buffer in buffers
                       for bucket in buffer.buckets}
        self._buffer_of = {id(p): b for b in buffers for p in b.params}
        for chunk_units in units:
            for u in chunk_units:
                keys = dict.fromkeys(self._key(p) for p in u.params)  # ordered, each bucket once
                u.buckets = [self._slots[k] for k in keys]
        self._held = {}  # (chunk, "fwd" or "bwd") -> the unit index held for that pass
        self._prefetched = set()  # (chunk, unit) whose gather was started ahead
        self._callback_queued = False
        self.peak_gathered_bytes = 0  # the most full-size weight bytes held at once (benchmarks/sharded_dp.py)
        self.fp8 = None  # --fp8-param-gather: the fp8_shard.Fp8Shard that moves the FP8 weights as codes
        for c, (chunk, chunk_units) in enumerate(zip(model_chunks, units)):
            for i, u in enumerate(chunk_units):
                u.module.register_forward_pre_hook(self._enter_hook(c, i))
            chunk.register_forward_hook(self._exit_hook(c))

    def _key(self, p) -> tuple:
        buffer = self._buffer_of[id(p)]
        return id(buffer), buffer.bucket_of(p).index

    # --- hooks -------------------------------------------------------------------------------------
    def _enter_hook(self, c: int, i: int):
        def hook(module, args):
            self._forward_enter(c, i, args[0] if args and isinstance(args[0], torch.Tensor) else None)
        return hook

    def _exit_hook(self, c: int):
        def hook(module, args, output):
            held = self._held.pop((c, "fwd"), None)
            if held is not None:
                self._release(c, held)
            self._drop_prefetched(c)
            if isinstance(output, torch.Tensor) and output.requires_grad and self.chunks[c]:
                last = len(self.chunks[c]) - 1
                output.register_hook(lambda g: self._backward_enter(c, last))
        return hook

    def _forward_enter(self, c: int, i: int, x) -> None:
        if self._held.get((c, "bwd")) == i:
            return  # recomputation inside this unit's backward: it stays gathered
        previous = self._held.pop((c, "fwd"), None)
        if previous is not None:  # its forward is done: freed before the next gather, one unit held at a time
            self._release(c, previous)
        self._gather(c, i)
        self._held[(c, "fwd")] = i
        if self.prefetch and i + 1 < len(self.chunks[c]):
            self._prefetch(c, i + 1)
        if i > 0 and x is not None and x.requires_grad:  # (under full recomputation grad mode is off here)
            x.register_hook(lambda g: self._backward_enter(c, i - 1))

    def _backward_enter(self, c: int, i: int) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        previous = self._held.pop((c, "bwd"), None)
        if previous is not None:  # the gradient of its input is complete: its backward is done
            self._release(c, previous)
        self._gather(c, i)
        self._held[(c, "bwd")] = i
        if self.prefetch and i > 0:
            self._prefetch(c, i - 1)

    def start_step(self) -> None:
        """Between steps nothing is held for backward: a backward that raised (and so never ran its end
        callback) leaves no unit gathered and the callback is queued afresh next time."""
        self._end_backward()

    def _end_backward(self) -> None:
        self._callback_queued = False
        for key in [k for k in self._held if k[1] == "bwd"]:
            self._release(key[0], self._held.pop(key))
        self._drop_prefetched()

    # --- gathering ---------------------------------------------------------------------------------
    def _gather(self, c: int, i: int) -> None:
        unit = self.chunks[c][i]
        if (c, i) not in self._prefetched:
            self._ready()
            for slot in unit.buckets:
                slot.gather(async_op=False, codes=self.fp8)
        self._prefetched.discard((c, i))
        for slot in unit.buckets:
            slot.wait()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _prefetch(self, c: int, i: int) -> None:
        if (c, i) in self._prefetched:
            return
        self._ready()
        for slot in self.chunks[c][i].buckets:
            slot.gather(async_op=True, codes=self.fp8)
        self._prefetched.add((c, i))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _drop_prefetched(self, chunk=None) -> None:
        """Release gathers started ahead for a unit that was then not entered (of `chunk`, or all)."""
        for c, i in [k for k in self._prefetched if chunk is None or k[0] == chunk]:
            self._prefetched.discard((c, i))
            self._release(c, i)

    def _ready(self) -> None:
        if self.fp8 is not None:
            self.fp8.ready()

    def _release(self, c: int, i: int) -> None:
        for slot in self.chunks[c][i].buckets:
            slot.release()

    # --- outside forward and backward ---------------------------------------------------------------
    def local_param(self, p) -> torch.Tensor:
        """This rank's shard of `p` (flat, the elements the optimizer updates), a view of the stored shard."""
        return self._buffer_of[id(p)].local_slice(p, self._slots[self._key(p)].shard)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False):
        """Every weight gathered (checkpoint save and load); with `writeback` the weights as they are at the
        end (loaded into the parameters) become the shards."""
        slots = list(self._slots.values())
        for slot in slots:
            slot.gather(async_op=False)
        try:
            yield
            if writeback:
                for slot in slots:
                    lo, hi = slot.buffer.shard_bounds(slot.bucket)
                    slot.shard.copy_(slot.flat[lo:hi])
                self.changed()
        finally:
            for slot in slots:
                slot.release()

    @property
    def slots(self) -> list:
        return list(self._slots.values())

    def changed(self) -> None:
        """The shards were written (an optimizer step, a checkpoint load)."""
        if self.fp8 is not None:
            self.fp8.changed()

    def shard_bytes(self) -> int:
        return sum(s.shard.numel() * s.shard.element_size() for s in self._slots.values())

    def gathered_bytes(self) -> int:
        """Bytes of full-size weights held right now."""
        return sum(s.flat.numel() * s.flat.element_size() for s in self._slots.values() if s.holders > 0)

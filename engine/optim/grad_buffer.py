"""The contiguous fp32 main-grad buffer, split into buckets that reduce over dp as backward fills them.

Every trainable parameter gets `p.main_grad`, a view into one flat fp32 tensor (whatever the
parameter's dtype). A post-accumulate-grad hook adds each microbatch's `p.grad` into it and frees
`p.grad`, so bf16/fp16 gradients are accumulated in fp32. Parameters are laid out in reverse forward order
(param_shard.forward_order), roughly the order backward produces them, and cut into buckets of about
`bucket_numel` elements (engine.optim.buckets: the rule the planner replays too).

The schedule never says which microbatch is the last one, so the buffer counts: `start_step(n)` zeroes
the grads and expects n gradients per parameter; when every parameter of a bucket has had its n-th,
the bucket is complete. With `overlap`, its reduction starts right there, inside backward (all-reduce,
or reduce-scatter under the distributed optimizer, after dividing by dp); nothing is sent earlier.
`finish()` starts whatever is left, waits for all, then sums the gradients that are partial over TP
(sequence parallelism) and the embedding tied across the first and last pipeline stage (on one rank under
ZB-V, whose V places both ends there). Split backward (zero-bubble schedules) changes nothing here: a
weight's gradient arrives through the same hook from its deferred W pass, so a bucket is ready after the
W passes of its last microbatch.

Under the distributed optimizer every bucket is padded to a multiple of dp x cp and replica r owns the r-th
contiguous slice of each bucket; `local_range(p)` says which elements of `p` fall in this rank's slices.
The tied embedding gets a bucket of its own so that its slice covers the same elements on both stages.

With `shard_grads` (ZeRO-2 and -3) no full gradient is kept: the buffer holds this rank's slices only.
Each bucket stages its gradients in a full-size fp32 tensor that exists from the first gradient of a
microbatch round to its reduce-scatter, which adds the round's reduced slice into the shard and frees the
staging. A round ends when every parameter of the bucket has had one more gradient (the same instant on
every replica: they run the same schedule); at most one round's reduce-scatter is in flight. `units`
(ZeRO-3) cuts buckets at the boundaries of the units whose weights are gathered together.
`local_grad(p)` is the view of p's reduced slice in every mode.

With `fuse` (gradient-accumulation fusion, engine.parallel.grad_accumulation) each parameter whose device and
dtype allow it gets a sink: a linear's backward adds its weight gradient straight into the parameter's fp32
gradient (`main_grad`, or under shard_grads the round's staging), and the hook, which autograd still runs,
counts it and adds whatever else reached `.grad`.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from engine.loss import replica_divisor
from engine.optim.buckets import cut_buckets
from engine.optim.param_shard import forward_order
from engine.parallel import comm, grad_accumulation
from engine.parallel.layers import spec_of

DEFAULT_BUCKET_NUMEL = 40_000_000
SHARD_ALIGN = 64  # elements per dp shard boundary, so every shard starts on a 256-byte boundary


class Bucket:
    def __init__(self, index: int, params: list, start: int, end: int):
        self.index = index
        self.params = params
        self.start, self.end = start, end  # buffer coordinates, padding included
        self.dtype = params[0].dtype
        self.data = None      # the full-size gradients (not under shard_grads)
        self.shard = None     # this rank's slice of them (all of them when not distributed)
        self.staging = None   # shard_grads: the round's full-size gradients until its reduce-scatter
        self.first = 0        # index of its first parameter in the buffer's list
        self.pending = len(params)
        self.rounds = 0       # shard_grads: rounds reduce-scattered this step
        self.launched = False
        self.work = None

    @property
    def size(self) -> int:
        return self.end - self.start


class _Sink:
    """Parameter i's sink for fused weight gradients (engine.parallel.grad_accumulation.attach). It holds the buffer
    weakly, as the hook does: a buffer gone leaves the gradient to the linear (target None)."""

    def __init__(self, buffer_ref, i: int):
        self._buffer, self.i = buffer_ref, i

    def target(self):
        buffer = self._buffer()
        return None if buffer is None else buffer.target(self.i)

    def arrived(self) -> None:
        self._buffer().arrived(self.i)


class GradBuffer:
    def __init__(self, model_chunks: list, ctx, *, distributed: bool, overlap: bool,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, experts: bool = False, shard_grads: bool = False,
                 units: Optional[list] = None, fuse: bool = False):
        """`experts`: hold the MoE experts' parameters (ParamSpec.ep_axis set) instead of all the others.
        `shard_grads`: keep this rank's slices only (needs `distributed`); `units`: lists of parameters no
        bucket may mix (a bucket then holds at most one unit's parameters, whatever `bucket_numel`); `fuse`:
        weight gradients added into the fp32 gradients by their products, where the device allows it."""
        self.ctx = ctx
        self.distributed = distributed
        self.shard_grads = shard_grads and distributed
        self.overlap = overlap
        self.experts = experts
        self._inflight = None
        self.peak_staging_bytes = 0  # shard_grads: the most full-size fp32 gradient bytes alive at once
        # Replicas of these weights: dp x cp ranks (CP ranks hold the same weights and add their positions'
        # gradients), or for experts the dp/ep x cp ranks holding the same experts. The distributed
        # optimizer shards over all of them.
        if experts:
            self.replicas, self.replica_rank, self.group = ctx.edp_cp_size, ctx.edp_cp_rank, ctx.edp_cp_group
        else:
            self.replicas, self.replica_rank, self.group = ctx.dp_cp_size, ctx.dp_cp_rank, ctx.dp_cp_group
        self.params: list = []
        self.offsets: list = []
        self.buckets: list = []
        self._bucket_of: list = []
        self._index: dict = {}
        unit_of = {id(p): u for u, unit in enumerate(units or []) for p in unit}
        self._layout(model_chunks, bucket_numel, SHARD_ALIGN * self.replicas if distributed else 1, unit_of)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        total = self.buckets[-1].end if self.buckets else 0
        self.data = torch.zeros(total // self.replicas if self.shard_grads else total, dtype=torch.float32,
                                device=self.device)
        for b in self.buckets:
            if self.shard_grads:
                b.shard = self.data[b.start // self.replicas:b.end // self.replicas]
                continue
            b.data = self.data[b.start:b.end]
            lo, hi = self.shard_bounds(b)
            b.shard = b.data[lo:hi]
            for p in b.params:
                p.main_grad = self._flat(p, b.data).view_as(p)
        self._counts = [0] * len(self.params)
        self._num_microbatches = None
        ref = weakref.ref(self)  # see _hook
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))
            fused = fuse and grad_accumulation.supported(p.device, p.dtype)
            grad_accumulation.attach(p, _Sink(ref, i) if fused else None)

    def _layout(self, model_chunks: list, bucket_numel: int, pad: int, unit_of: dict) -> None:
        """Lay this buffer's parameters out in buckets (engine.optim.buckets.cut_buckets), each padded to `pad`."""
        params = self._own_params(model_chunks)
        # A bucket never spans two model chunks, two dtypes or (ZeRO-3) two gathered units.
        items = [(p.numel(), spec_of(p).tied, (c, p.dtype, unit_of.get(id(p)))) for c, p in params]
        bucket_of, sizes = cut_buckets(items, None if unit_of else bucket_numel)
        members = [[] for _ in sizes]
        for (_, p), b in zip(params, bucket_of):
            members[b].append(p)
        end = 0
        for b, group in enumerate(members):
            bucket = Bucket(b, group, end, end + -(-sizes[b] // pad) * pad)
            bucket.first = len(self.params)
            for p in group:
                self._index[id(p)] = len(self.params)
                self.params.append(p)
                self.offsets.append(end)
                self._bucket_of.append(b)
                end += p.numel()
            self.buckets.append(bucket)
            end = bucket.end

    def _own_params(self, model_chunks: list) -> list:
        """(chunk index, parameter) of the trainable parameters this buffer holds, each once, in reverse forward
        order: roughly the order backward completes their gradients (the output weight's first, so its bucket
        can be reduced, or its ZeRO-2 round staged and freed, early)."""
        seen, out = set(), []
        for c in reversed(range(len(model_chunks))):
            for p in reversed(forward_order(model_chunks[c])):
                if not p.requires_grad or id(p) in seen or (spec_of(p).ep_axis is not None) != self.experts:
                    continue
                seen.add(id(p))
                out.append((c, p))
        return out

    def _flat(self, p, tensor: torch.Tensor) -> torch.Tensor:
        """p's elements within `tensor`, a bucket-sized tensor of p's bucket."""
        off = self.offset_in_bucket(p)[1]
        return tensor[off:off + p.numel()]

    def _hook(self, i: int):
        # The hook lives in autograd's C++ state of the parameter, out of sight of the garbage collector: holding
        # the buffer strongly would make buffer -> parameter -> hook -> buffer a cycle never collected, keeping
        # the buffer, its process group (and its threads) and the parameters alive for the rest of the process.
        ref = weakref.ref(self)

        def on_grad(p):
            self = ref()
            if self is None:  # the buffer is gone: the gradient stays in p.grad
                return
            if p.grad is not None:  # None: all of it went into the target already (a fused product)
                self.target(i).add_(p.grad)
                p.grad = None
            self.arrived(i)
        return on_grad

    def target(self, i: int) -> torch.Tensor:
        """The fp32 tensor shaped like parameter i that its gradient is summed into now: its main_grad, or under
        shard_grads its part of the bucket's staging (made at the round's first gradient)."""
        self._check_in_step()
        p = self.params[i]
        if not self.shard_grads:
            return p.main_grad
        bucket = self.buckets[self._bucket_of[i]]
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.size, dtype=torch.float32, device=self.device)
            self._note_staging()
        return self._flat(p, bucket.staging).view_as(p)

    def arrived(self, i: int) -> None:
        """Parameter i's gradient of one more microbatch is in its target: count it, and start its bucket's
        reduction (or end its round) when that was the bucket's last."""
        self._check_in_step()
        p, bucket = self.params[i], self.buckets[self._bucket_of[i]]
        self._counts[i] += 1
        if self._counts[i] > self._num_microbatches:
            raise RuntimeError(f"parameter {tuple(p.shape)} received more gradients than the "
                               f"{self._num_microbatches} microbatches announced to start_step")
        if self.shard_grads:
            if self._counts[i] == bucket.rounds + 1:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._end_round(bucket)
        elif self._counts[i] == self._num_microbatches:
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap:
                self._launch(bucket)

    def _check_in_step(self) -> None:
        if self._num_microbatches is None:
            raise RuntimeError("a gradient arrived outside a step: call optimizer.start_step(num_microbatches) "
                               "before the first backward of the step")

    def start_step(self, num_microbatches: int) -> None:
        self._complete_inflight()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.pending, b.launched, b.work, b.rounds, b.staging = len(b.params), False, None, 0, None
        self.data.zero_()
        self._counts = [0] * len(self.params)
        self._num_microbatches = num_microbatches

    def shard_bounds(self, bucket: Bucket, replica: Optional[int] = None) -> tuple:
        """This rank's (or replica `replica`'s) slice of `bucket`, relative to the bucket's start."""
        if not self.distributed:
            return 0, bucket.size
        size, r = bucket.size // self.replicas, self.replica_rank if replica is None else replica
        return r * size, (r + 1) * size

    def _average(self, grads: torch.Tensor) -> None:
        divisor = replica_divisor(self.ctx)  # engine.loss: the one normalisation rule
        if divisor > 1:
            grads.div_(divisor)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self._average(bucket.data)
        if self.replicas == 1:
            return
        group = self.group
        if self.distributed:
            bucket.work = comm.reduce_scatter_into(bucket.shard, bucket.data, group=group, async_op=True)
        else:
            bucket.work = comm.all_reduce(bucket.data, group=group, async_op=True)

    # --- shard_grads: one reduce-scatter per microbatch round ------------------------------------
    def _end_round(self, bucket: Bucket) -> None:
        """Reduce-scatter the round's staged gradients into the shard and free them; count the next round."""
        bucket.rounds += 1
        counts = self._counts[bucket.first:bucket.first + len(bucket.params)]
        more = bucket.rounds < self._num_microbatches
        bucket.pending = sum(1 for c in counts if c < bucket.rounds + 1) if more else -1
        self._complete_inflight()  # one round in flight at a time bounds the staging memory
        staged, bucket.staging = bucket.staging, None
        self._average(staged)
        if self.replicas == 1:
            bucket.shard.add_(staged)
            return self._end_round(bucket) if bucket.pending == 0 else None
        out = torch.empty_like(bucket.shard)
        work = comm.reduce_scatter_into(out, staged, group=self.group, async_op=self.overlap)
        self._inflight = (work, out, staged, bucket)
        if not self.overlap:
            self._complete_inflight()
        if bucket.pending == 0:  # every parameter already has its gradient of the next round
            self._end_round(bucket)

    def _note_staging(self) -> None:
        """Track the most staging bytes alive at once (staged rounds and the one in flight)."""
        alive = sum(b.size for b in self.buckets if b.staging is not None)
        if self._inflight is not None:
            alive += self._inflight[2].numel()
        self.peak_staging_bytes = max(self.peak_staging_bytes, 4 * alive)

    def _complete_inflight(self) -> None:
        if self._inflight is not None:
            work, out, _, bucket = self._inflight
            self._inflight = None
            if work is not None:
                work.wait()
            bucket.shard.add_(out)

    def _finish_rounds(self) -> None:
        """Rounds a parameter without gradients left open (the same on every replica) are reduced now."""
        for b in self.buckets:
            if b.staging is not None:
                b.pending = 0
                self._end_round(b)
        self._complete_inflight()

    def finish(self) -> None:
        if self.shard_grads:
            self._finish_rounds()
        for b in self.buckets:
            if not b.launched and not self.shard_grads:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._num_microbatches = None
        ctx = self.ctx
        if ctx.tp_size > 1:  # one all-reduce for the replicated parameters whose gradients each TP rank has in part
            self._sum_over([p for p in self.params if spec_of(p).tp_partial_grad
                            or (spec_of(p).sp_partial_grad and ctx.seq_split > 1)], ctx.tp_group)
        tied = [p for p in self.params if spec_of(p).tied]
        if len(tied) == 2:  # ZB-V's V puts the embedding and the loss (with its copy) on one rank
            self._sum_local(*tied)
        elif ctx.embedding_group is not None:
            self._sum_over(tied, ctx.embedding_group)

    def _sum_local(self, a, b) -> None:
        """Both copies of the tied embedding are here: each gets the sum of the two (reduced) gradients."""
        ga, gb = self.local_grad(a), self.local_grad(b)
        if ga is not None:
            ga.add_(gb)
            gb.copy_(ga)

    def _sum_over(self, params: list, group) -> None:
        """All-reduce the reduced (locally owned) part of these grads; peers share the buffer layout."""
        views = [v for v in (self.local_grad(p) for p in params) if v is not None]
        if not views:
            return
        flat = torch.cat(views)
        comm.all_reduce(flat, group=group)
        for v, piece in zip(views, flat.split([v.numel() for v in views])):
            v.copy_(piece)

    def local_range(self, p, replica: Optional[int] = None):
        """(start, end) of the flat elements of `p` whose reduced grads this rank (or replica `replica`: the
        layout is the same on every replica) holds, or None."""
        i = self._index[id(p)]
        n = p.numel()
        if not self.distributed:
            return 0, n
        bucket = self.buckets[self._bucket_of[i]]
        lo, hi = self.shard_bounds(bucket, replica)
        off = self.offsets[i] - bucket.start
        start, end = max(off, lo) - off, min(off + n, hi) - off
        return (start, end) if end > start else None

    def local_slice(self, p, shard: torch.Tensor):
        """The elements local_range(p) of p within `shard`, a tensor shaped like this rank's slice of p's
        bucket (the reduced gradients, or under ZeRO-3 the weights' shard); None if this rank has none."""
        r = self.local_range(p)
        if r is None:
            return None
        bucket, off = self.offset_in_bucket(p)
        lo = self.shard_bounds(bucket)[0]
        return shard[off + r[0] - lo:off + r[1] - lo]

    def local_grad(self, p):
        """This rank's reduced gradient elements of `p` (flat), or None."""
        return self.local_slice(p, self.buckets[self._bucket_of[self._index[id(p)]]].shard)

    def bucket_of(self, p) -> Bucket:
        return self.buckets[self._bucket_of[self._index[id(p)]]]

    def offset_in_bucket(self, p) -> tuple:
        """(bucket, offset of `p` from the bucket's start)."""
        i = self._index[id(p)]
        bucket = self.buckets[self._bucket_of[i]]
        return bucket, self.offsets[i] - bucket.start

    def scale_local_grads(self, factor: float) -> None:
        """Multiply the grads the optimizer will read (this rank's shards) by `factor`."""
        for b in self.buckets:
            b.shard.mul_(factor)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank keeps between steps (the shards under shard_grads)."""
        return self.data.numel() * self.data.element_size()

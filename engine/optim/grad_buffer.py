"""The contiguous fp32 main-grad buffer, split into buckets that reduce over dp as backward fills them.

Every trainable parameter gets `p.main_grad`, a view into one flat fp32 tensor (whatever the
parameter's dtype). A post-accumulate-grad hook adds each microbatch's `p.grad` into it and frees
`p.grad`, so bf16/fp16 gradients are accumulated in fp32. Parameters are laid out in reverse order,
roughly the order backward produces them, and cut into buckets of about `bucket_numel` elements.

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
"""
from __future__ import annotations

import torch

from engine.parallel import comm
from engine.parallel.layers import spec_of

DEFAULT_BUCKET_NUMEL = 40_000_000
SHARD_ALIGN = 64  # elements per dp shard boundary, so every shard starts on a 256-byte boundary


class Bucket:
    def __init__(self, index: int, params: list, start: int, end: int):
        self.index = index
        self.params = params
        self.start, self.end = start, end  # buffer coordinates, padding included
        self.dtype = params[0].dtype
        self.data = None
        self.pending = len(params)
        self.launched = False
        self.work = None

    @property
    def size(self) -> int:
        return self.end - self.start


class GradBuffer:
    def __init__(self, model_chunks: list, ctx, *, distributed: bool, overlap: bool,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, experts: bool = False):
        """`experts`: hold the MoE experts' parameters (ParamSpec.ep_axis set) instead of all the others."""
        self.ctx = ctx
        self.distributed = distributed
        self.overlap = overlap
        self.experts = experts
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
        self._layout(model_chunks, bucket_numel, SHARD_ALIGN * self.replicas if distributed else 1)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.data = torch.zeros(self.buckets[-1].end if self.buckets else 0, dtype=torch.float32, device=device)
        for b in self.buckets:
            b.data = self.data[b.start:b.end]
        for i, p in enumerate(self.params):
            p.main_grad = self.data[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)
        self._counts = [0] * len(self.params)
        self._num_microbatches = None
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _layout(self, model_chunks: list, bucket_numel: int, pad: int) -> None:
        seen, current, current_numel, end = set(), [], 0, 0

        def close():
            nonlocal current, current_numel, end
            if not current:
                return
            start = end
            for p in current:
                self._index[id(p)] = len(self.params)
                self.params.append(p)
                self.offsets.append(end)
                self._bucket_of.append(len(self.buckets))
                end += p.numel()
            end = start + -(-(end - start) // pad) * pad
            self.buckets.append(Bucket(len(self.buckets), current, start, end))
            current, current_numel = [], 0

        # Reverse order approximates the order in which backward completes gradients.
        for chunk in reversed(model_chunks):
            for p in reversed(list(chunk.parameters())):
                if not p.requires_grad or id(p) in seen or (spec_of(p).ep_axis is not None) != self.experts:
                    continue
                seen.add(id(p))
                alone = spec_of(p).tied
                if current and (alone or p.dtype != current[0].dtype):
                    close()
                current.append(p)
                current_numel += p.numel()
                if alone or current_numel >= bucket_numel:
                    close()
            close()  # a bucket never spans two model chunks

    def _hook(self, i: int):
        def on_grad(p):
            if self._num_microbatches is None:
                raise RuntimeError("a gradient arrived outside a step: call optimizer.start_step(num_microbatches) "
                                   "before the first backward of the step")
            p.main_grad.add_(p.grad)
            p.grad = None
            self._counts[i] += 1
            if self._counts[i] > self._num_microbatches:
                raise RuntimeError(f"parameter {tuple(p.shape)} received more gradients than the "
                                   f"{self._num_microbatches} microbatches announced to start_step")
            if self._counts[i] == self._num_microbatches:
                bucket = self.buckets[self._bucket_of[i]]
                bucket.pending -= 1
                if bucket.pending == 0 and self.overlap:
                    self._launch(bucket)
        return on_grad

    def start_step(self, num_microbatches: int) -> None:
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.pending, b.launched, b.work = len(b.params), False, None
        self.data.zero_()
        self._counts = [0] * len(self.params)
        self._num_microbatches = num_microbatches

    def shard_bounds(self, bucket: Bucket) -> tuple:
        """This rank's slice of `bucket`, relative to the bucket's start."""
        if not self.distributed:
            return 0, bucket.size
        size = bucket.size // self.replicas
        return self.replica_rank * size, (self.replica_rank + 1) * size

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        # The loss is already averaged over microbatches; average over dp too. CP ranks' parts add up (each
        # rank's loss is its positions' share of the mean), so they are summed, not averaged; so are the
        # parts an expert's owner got from the other ranks of its EP group (already inside its gradient).
        if self.ctx.dp_size > 1:
            bucket.data.div_(self.ctx.dp_size)
        if self.replicas == 1:
            return
        group = self.group
        if self.distributed:
            lo, hi = self.shard_bounds(bucket)
            bucket.work = comm.reduce_scatter_into(bucket.data[lo:hi], bucket.data, group=group, async_op=True)
        else:
            bucket.work = comm.all_reduce(bucket.data, group=group, async_op=True)

    def finish(self) -> None:
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._num_microbatches = None
        ctx = self.ctx
        if ctx.seq_split > 1:
            self._sum_over([p for p in self.params if spec_of(p).sp_partial_grad], ctx.tp_group)
        tied = [p for p in self.params if spec_of(p).tied]
        if len(tied) == 2:  # ZB-V's V puts the embedding and the loss (with its copy) on one rank
            self._sum_local(*tied)
        elif ctx.embedding_group is not None:
            self._sum_over(tied, ctx.embedding_group)

    def _sum_local(self, a, b) -> None:
        """Both copies of the tied embedding are here: each gets the sum of the two (reduced) gradients."""
        r = self.local_range(a)
        if r is not None:
            ga, gb = a.main_grad.view(-1)[r[0]:r[1]], b.main_grad.view(-1)[r[0]:r[1]]
            ga.add_(gb)
            gb.copy_(ga)

    def _sum_over(self, params: list, group) -> None:
        """All-reduce the reduced (locally owned) part of these grads; peers share the buffer layout."""
        views = []
        for p in params:
            r = self.local_range(p)
            if r is not None:
                views.append(p.main_grad.view(-1)[r[0]:r[1]])
        if not views:
            return
        flat = torch.cat(views)
        comm.all_reduce(flat, group=group)
        for v, piece in zip(views, flat.split([v.numel() for v in views])):
            v.copy_(piece)

    def local_range(self, p):
        """(start, end) of the flat elements of `p` whose reduced grads this rank holds, or None."""
        i = self._index[id(p)]
        n = p.numel()
        if not self.distributed:
            return 0, n
        bucket = self.buckets[self._bucket_of[i]]
        lo, hi = self.shard_bounds(bucket)
        off = self.offsets[i] - bucket.start
        start, end = max(off, lo) - off, min(off + n, hi) - off
        return (start, end) if end > start else None

    def offset_in_bucket(self, p) -> tuple:
        """(bucket, offset of `p` from the bucket's start)."""
        i = self._index[id(p)]
        bucket = self.buckets[self._bucket_of[i]]
        return bucket, self.offsets[i] - bucket.start

    def scale_local_grads(self, factor: float) -> None:
        """Multiply the grads the optimizer will read (this rank's shards) by `factor`."""
        if not self.distributed:
            self.data.mul_(factor)
            return
        for b in self.buckets:
            lo, hi = self.shard_bounds(b)
            b.data[lo:hi].mul_(factor)

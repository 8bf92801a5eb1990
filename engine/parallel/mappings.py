"""Tensor-parallel communication as autograd functions, each paired with its adjoint.

Forward op           | backward op         | where
---------------------|---------------------|-----------------------------------------------
copy                 | all-reduce          | input of a column-parallel linear (no SP)
all-reduce           | copy                | output of a row-parallel linear (no SP)
all-gather (seq)     | reduce-scatter (seq)| input of a column-parallel linear under SP
reduce-scatter (seq) | all-gather (seq)    | output of a row-parallel linear under SP

The layers do not choose between the rows: `enter_tp` (the input of a tensor-parallel region) and
`exit_tp` (its output) take the pair the parallel context calls for, so sequence parallelism is
decided here and in the context, and nowhere in the model.
"""
from __future__ import annotations

import torch

from engine.parallel import comm


def _size(group) -> int:
    return comm.world_size(group) if group is not None else 1


def _all_reduce(x, group):
    if _size(group) == 1:
        return x
    # Never in place: the caller still owns its input (forward), and autograd may hand the same gradient
    # tensor to another branch (backward), which must not see the sum.
    x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, group)
    return x


def _gather_seq(x, group):
    n = _size(group)
    if n == 1:
        return x
    out = torch.empty((x.shape[0] * n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x, group)
    return out


def _reduce_scatter_seq(x, group):
    n = _size(group)
    if n == 1:
        return x
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x, group)
    return out


def _pair(fwd, bwd, name):
    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return fwd(x, group)

        @staticmethod
        def backward(ctx, g):
            return bwd(g, ctx.group), None

    _Op.__name__ = _Op.__qualname__ = name
    return _Op


_Copy = _pair(lambda x, g: x, _all_reduce, "CopyToTP")
_Reduce = _pair(_all_reduce, lambda x, g: x, "ReduceFromTP")
_GatherSeq = _pair(_gather_seq, _reduce_scatter_seq, "GatherFromSP")
_ReduceScatterSeq = _pair(_reduce_scatter_seq, _gather_seq, "ReduceScatterToSP")


def copy_to_tp(x, group):
    return _Copy.apply(x, group)


def reduce_from_tp(x, group):
    return _Reduce.apply(x, group)


def gather_from_sp(x, group):
    return _GatherSeq.apply(x, group)


def reduce_scatter_to_sp(x, group):
    return _ReduceScatterSeq.apply(x, group)


def enter_tp(x, ctx):
    """Into a tensor-parallel region: [s/tp, b, h] all-gathered under sequence parallelism, else copied."""
    return gather_from_sp(x, ctx.tp_group) if ctx.sequence_parallel else copy_to_tp(x, ctx.tp_group)


def exit_tp(x, ctx):
    """Out of one: partial sums reduce-scattered to [s/tp, b, h] under sequence parallelism, else all-reduced."""
    return reduce_scatter_to_sp(x, ctx.tp_group) if ctx.sequence_parallel else reduce_from_tp(x, ctx.tp_group)

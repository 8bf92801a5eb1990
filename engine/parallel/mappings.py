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

A column-parallel linear enters through `enter_tp_linear`, which fuses the entry with the matmul. Under
sequence parallelism (`gather_linear`) it keeps only this rank's [s/tp, b, h] shard for backward and
all-gathers it again there (as Megatron-LM does), instead of keeping the gathered [s, b, h] input:
that is what makes sequence parallelism divide these inputs' memory by tp. The re-gather is started
before the input-gradient matmul and waited for after it, and the input gradient's reduce-scatter
runs while the weight gradient is computed, so on a GPU both hide behind matmuls.

Under a split backward (zero-bubble pipeline schedules) the gathering linear leaves its weight's gradient
to engine.parallel.weight_grad_store, handing it the re-gather of its input as a callable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.parallel import comm, grad_accumulation
from engine.parallel.weight_grad_store import bias_grad, defer, deferral_of, linear, rows, weight_grad_or_fused


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


def reduce_scatter_seq(x, group):
    """`x` summed over `group`, this rank's dim-0 (sequence) slice kept, outside autograd: for an autograd function
    that does its own tensor-parallel communication (engine.fp8's linears gather FP8 codes under SP)."""
    return _reduce_scatter_seq(x, group)


def reduce_scatter_to_sp(x, group):
    return _ReduceScatterSeq.apply(x, group)


def enter_tp(x, ctx):
    """Into a tensor-parallel region: [s/tp, b, h] all-gathered under sequence parallelism, else copied."""
    return gather_from_sp(x, ctx.tp_group) if ctx.sequence_parallel else copy_to_tp(x, ctx.tp_group)


def exit_tp(x, ctx):
    """Out of one: partial sums reduce-scattered to [s/tp, b, h] under sequence parallelism, else all-reduced."""
    return reduce_scatter_to_sp(x, ctx.tp_group) if ctx.sequence_parallel else reduce_from_tp(x, ctx.tp_group)


class _GatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b, saving the shard x rather than the gathered input.

    W [..., out, in] has its leading dims taken as output rows (a stacked SwiGLU weight); `deferral`
    (param, store) leaves W's gradient to the store; else it is added into W's fp32 gradient where that is fused
    (engine.parallel.grad_accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, deferral=None):
        ctx.group, ctx.deferral = group, deferral
        ctx.sink = grad_accumulation.fusing(weight) if deferral is None else None
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, group), rows(weight), None if bias is None else bias.reshape(-1))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, n = ctx.group, _size(ctx.group)
        want_dw = ctx.deferral is None and ctx.needs_input_grad[1]
        full, gathering = x, None
        if n > 1 and want_dw:
            full = torch.empty((x.shape[0] * n, *x.shape[1:]), dtype=x.dtype, device=x.device)
            gathering = comm.all_gather_into(full, x, group, async_op=True)
        dx_full = dy.matmul(rows(weight))
        dx, scattering = dx_full, None
        if n > 1:
            if gathering is not None:
                gathering.wait()
            dx = torch.empty(x.shape, dtype=dx_full.dtype, device=x.device)
            scattering = comm.reduce_scatter_into(dx, dx_full, group, async_op=True)
        dw = weight_grad_or_fused(ctx.sink, full, dy, weight.shape) if want_dw else None
        db = bias_grad(dy, ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
        if ctx.deferral is not None:
            defer(ctx.deferral, lambda: _gather_seq(x, group), dy)
        if scattering is not None:
            scattering.wait()
        return dx, dw, db, None, None


def gather_linear(x, weight, bias, group):
    """A column-parallel linear on a sequence-parallel input [s/tp, b, h]: output [s, b, out/tp]."""
    return _GatherLinear.apply(x, weight, bias, group)


def enter_tp_linear(x, weight, bias, ctx):
    """`linear(enter_tp(x, ctx), weight, bias)`, keeping only the sequence shard for backward under SP."""
    if ctx.sequence_parallel and _size(ctx.tp_group) > 1:
        deferral = deferral_of(weight)
        return _GatherLinear.apply(x, weight if deferral is None else weight.detach(), bias, ctx.tp_group, deferral)
    return linear(copy_to_tp(x, ctx.tp_group), weight, bias)

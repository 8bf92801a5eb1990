"""Split backward (zero-bubble pipeline schedules, Qi et al. 2024): weight gradients kept for a later W pass.

While `deferring_weight_grads(store)` is active, the linears' forwards (and forwards recomputed inside
backward) give backward only the input and bias gradients to compute; each weight's gradient is left in
`store` as what it needs (this rank's input, or under sequence parallelism the re-gather of its shard,
which the gathering linear of engine.parallel.mappings hands in as a callable, and the output gradient)
and computed by `weight_grads(store)` in a later W pass, which hands it to autograd as the weight's
gradient (or, under gradient-accumulation fusion, adds it into the weight's fp32 gradient and counts it
there: engine.parallel.grad_accumulation). The autograd graph is never edited: the weight enters the
linear detached, so backward has no edge to it, and the W pass is the weight's only gradient in that
microbatch, which is what the grad buffer's accumulate hooks count. The pipeline runner keeps one store per (model chunk, microbatch).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from engine.parallel import grad_accumulation

_deferred = None  # the store of the pass being run under deferring_weight_grads, else None


def rows(weight):
    """W [..., out, in] as a matrix, its leading dims the output rows (a stacked SwiGLU weight)."""
    return weight.reshape(-1, weight.shape[-1])


def weight_grad(x, dy, shape):
    """dW = dy^T x summed over every token, in the weight's own shape."""
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])).view(shape)


def weight_grad_or_fused(sink, x, dy, shape):
    """dW = dy^T x, or None once added into the fp32 gradient of `sink` (engine.parallel.grad_accumulation: the
    weight's sink when its gradient is fused, else None)."""
    target = sink.target() if sink is not None else None
    if target is None:
        return weight_grad(x, dy, shape)
    grad_accumulation.accumulate(target, x, dy)
    return None


def bias_grad(dy, shape):
    return dy.reshape(-1, dy.shape[-1]).sum(0).view(shape)


def deferral_of(weight):
    """(weight, store) when this weight's gradient is to be deferred: a store is active and it is a parameter."""
    if _deferred is None or not (weight.is_leaf and weight.requires_grad):
        return None
    return weight, _deferred


def defer(deferral, inputs: Callable, dy) -> None:
    """Leave W's gradient to the W pass: it keeps what gives the linear's input (`inputs()`) and its output
    gradient."""
    param, store = deferral
    store.append((param, lambda: weight_grad_or_fused(grad_accumulation.fusing(param), inputs(), dy, param.shape)))


class _Linear(torch.autograd.Function):
    """y = x W^T + b whose backward computes x's and b's gradients, and W's its own way: leaves it to the store
    (`deferral`: W came in detached) or adds it into W's fp32 gradient (`sink`: engine.parallel.grad_accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferral, sink):
        ctx.deferral, ctx.sink, ctx.bias_shape = deferral, sink, None if bias is None else bias.shape
        ctx.save_for_backward(x, weight)
        return F.linear(x, rows(weight), None if bias is None else bias.reshape(-1))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(rows(weight)) if ctx.needs_input_grad[0] else None
        db = bias_grad(dy, ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
        dw = None
        if ctx.deferral is not None:
            defer(ctx.deferral, lambda: x, dy)
        elif ctx.needs_input_grad[1]:
            dw = weight_grad_or_fused(ctx.sink, x, dy, weight.shape)
        return dx, dw, db, None, None


def linear(x, weight, bias=None):
    """x W^T + b, W [..., out, in] with its leading dims as output rows; W's gradient deferred while
    `deferring_weight_grads` is active, else added into its fp32 gradient where that is fused."""
    deferral = deferral_of(weight)
    if deferral is not None:
        return _Linear.apply(x, weight.detach(), bias, deferral, None)
    sink = grad_accumulation.fusing(weight) if torch.is_grad_enabled() and weight.requires_grad else None
    if sink is not None:
        return _Linear.apply(x, weight, bias, None, sink)
    return F.linear(x, rows(weight), None if bias is None else bias.reshape(-1))


@contextlib.contextmanager
def deferring_weight_grads(store: list):
    """Within: linears defer their weights' gradients into `store` (see the module docstring)."""
    global _deferred
    previous, _deferred = _deferred, store
    try:
        yield store
    finally:
        _deferred = previous


def weight_grads(store: list) -> None:
    """The W pass: every weight gradient deferred into `store`, handed to autograd as the weight's gradient
    (accumulation and its hooks run as after a whole backward); a weight met twice gets one sum. A gradient fused
    into the weight's fp32 gradient (its compute gave None) is counted there instead, once the weight's last is in."""
    left = collections.Counter(id(p) for p, _ in store)
    partial = {}
    for param, compute in store:
        with torch.no_grad():  # as inside backward
            grad, before = compute(), partial.pop(id(param), None)
            grad = before if grad is None else grad if before is None else before + grad
        left[id(param)] -= 1
        if left[id(param)]:
            partial[id(param)] = grad
        elif grad is not None:
            torch.autograd.backward(param, grad)
        else:
            grad_accumulation.fusing(param).arrived()
    store.clear()

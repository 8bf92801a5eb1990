"""Memoising what a layout search asks for again and again, and the memoised counts themselves.

A search estimates thousands of layouts of one model, and each estimate asked anew for sums over the model's layers
(FLOPs, attention pairs, keys per query: each layer's mask can differ) and for each pipeline rank's parameter state,
which depend on the model and the degrees but not on the micro batch or recomputation the search varies: most of
its time went there. Within `pinned(model)` (the search's own copy of the model, which nothing changes meanwhile)
these are kept per (function, arguments); outside it every call computes afresh, so a model or a rule changed
between calls (a test's monkeypatch) is never answered from a stale table.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

from engine import attention_mask, flops
from engine.layout import Layout
from engine.planner import params

_PINNED: dict = {}  # id(model) -> (model, its memo table) while a search holds it


@contextlib.contextmanager
def pinned(model):
    """Memoise the counts of `model` within the block; the caller promises not to change the model meanwhile."""
    _PINNED[id(model)] = (model, {})
    try:
        yield model
    finally:
        del _PINNED[id(model)]


def memoised(fn):
    """fn(model, *args), kept per (fn, args) while `model` is pinned (lists in args read as tuples)."""
    @functools.wraps(fn)
    def counted(model, *args):
        held = _PINNED.get(id(model))
        if held is None or held[0] is not model:
            return fn(model, *args)
        key = (fn.__qualname__, fn.__module__, tuple(tuple(a) if isinstance(a, list) else a for a in args))
        table = held[1]
        if key not in table:
            table[key] = fn(model, *args)
        return table[key]
    return counted


mean_keys_per_query = memoised(attention_mask.mean_keys_per_query)
attention_pairs = memoised(flops.attention_pairs)
split_backward_costs = memoised(flops.split_backward_costs)
flops_per_iteration = memoised(flops.flops_per_iteration)


def degrees(layout: Layout) -> Layout:
    """The layout as far as parameters and their state depend on it: the micro batch and recomputation left out."""
    return dataclasses.replace(layout, micro_batch_size=1, recompute="none")


_param_split = memoised(params.param_split_per_rank)


def param_split_per_rank(model, layout: Layout) -> list:
    """engine.planner.params.param_split_per_rank, memoised per degrees (callers read the list, never change it)."""
    return _param_split(model, degrees(layout))

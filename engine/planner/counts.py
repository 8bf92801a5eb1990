"""The model's FLOP and attention-pair counts, memoised for the planner, and the decorator that memoises them.

Each count is a sum over the model's layers (each layer's mask can differ) and is the same for every layout of
one model; a search estimates thousands of layouts and asked for them again each time (most of its time went
there). They are kept per (function, the model's settings, arguments): the settings are read by value, so a
model changed between calls gets fresh counts. engine/planner/memory.py memoises the per-rank parameter state the
same way (it depends on the degrees, not on the micro batch or the recomputation a search varies)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools

from engine import attention_mask, flops
from engine.layout import Layout
from engine.planner import params

_MEMO: dict = {}
_MEMO_LIMIT = 4096  # entries kept before the table starts over (a search uses a few dozen)


_PINNED: dict = {}  # id -> (model, its settings) of the models a search holds unchanged (see `pinned`)


@contextlib.contextmanager
def pinned(model):
    """Within the block, `model` (which nobody changes meanwhile: a search's own copy) is keyed by its settings read
    once, not at every call: reading them costs as much as the rest of a layout's estimate."""
    _PINNED[id(model)] = (model, repr(model))
    try:
        yield model
    finally:
        del _PINNED[id(model)]


def _settings(model) -> str:
    held = _PINNED.get(id(model))
    return held[1] if held is not None and held[0] is model else repr(model)


def memoised(fn):
    """fn(model, *args) computed once per (the model's settings, args); args hashable (lists become tuples)."""
    @functools.wraps(fn)
    def counted(model, *args):
        key = (fn.__name__, _settings(model), tuple(tuple(a) if isinstance(a, list) else a for a in args))
        if key not in _MEMO:
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[key] = fn(model, *args)
        return _MEMO[key]
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

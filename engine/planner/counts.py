"""The model's FLOP and attention-pair counts, memoised for the planner.

Each count is a sum over the model's layers (each layer's mask can differ) and is the same for every layout of
one model; a search estimates thousands of layouts and asked for them again each time (most of its time went
there). They are kept per (function, the model's settings, arguments): the settings are read by value, so a
model changed between calls gets fresh counts."""
from __future__ import annotations

import functools

from engine import attention_mask, flops

_MEMO: dict = {}
_MEMO_LIMIT = 4096  # entries kept before the table starts over (a search uses a few dozen)


def _memoised(fn):
    @functools.wraps(fn)
    def counted(model, *args):
        key = (fn.__name__, repr(model), tuple(tuple(a) if isinstance(a, list) else a for a in args))
        if key not in _MEMO:
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[key] = fn(model, *args)
        return _MEMO[key]
    return counted


mean_keys_per_query = _memoised(attention_mask.mean_keys_per_query)
attention_pairs = _memoised(flops.attention_pairs)
split_backward_costs = _memoised(flops.split_backward_costs)
flops_per_iteration = _memoised(flops.flops_per_iteration)

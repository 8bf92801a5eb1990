"""Where a grad buffer's buckets are cut: one pure rule, run by the grad buffer on real parameters and by the
planner (engine/planner/sharding.py) on the parameter list it derives, so that both lay out the same buckets.

Items come in the buffer's order (reverse forward order: roughly the order backward completes gradients). A
bucket closes once it holds `bucket_numel` elements, before and after an item that must be alone (the tied
embedding: its shard must cover the same elements on the two stages that hold a copy), and wherever the
item's `unit` changes (a model chunk's end, a dtype change, and under ZeRO-3 a gathered unit's end, where
`bucket_numel` is None: a unit's buckets are what one all-gather moves, whatever their size).
"""
from __future__ import annotations

from typing import Hashable, Iterable, Optional, Tuple

Item = Tuple[int, bool, Hashable]  # (numel, alone, unit)


def cut_buckets(items: Iterable[Item], bucket_numel: Optional[int]) -> tuple:
    """(the bucket index of each item, the elements each bucket holds) for `items` in the buffer's order."""
    bucket_of, sizes, used, held, unit = [], [], 0, 0, None  # held: items in the open bucket
    for numel, alone, u in items:
        if held and (alone or u != unit):
            sizes.append(used)
            used = held = 0
        bucket_of.append(len(sizes))
        used, held, unit = used + numel, held + 1, u
        if alone or (bucket_numel is not None and used >= bucket_numel):
            sizes.append(used)
            used = held = 0
    if held:
        sizes.append(used)
    return bucket_of, sizes

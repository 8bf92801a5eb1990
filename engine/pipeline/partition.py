"""Which decoder layers each pipeline stage and model chunk holds.

Stages are even by default; `first`/`last` give the first or last stage its own count and the rest is
split evenly. With v virtual stages per rank (interleaving), the layers form pp*v equal virtual stages
and model chunk c on pipeline rank r holds virtual stage c*pp + r.
"""
from __future__ import annotations

from typing import Optional


def stage_sizes(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list:
    """Layers per pipeline stage (no interleaving)."""
    if first is None and last is None:
        return [num_layers // pp] * pp
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    each = rest // middle if middle else 0
    sizes = [each] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, chunk: int,
                 first: Optional[int] = None, last: Optional[int] = None) -> list:
    """Global ids of the layers in model chunk `chunk` on pipeline rank `pp_rank`."""
    if vpp > 1:
        per = num_layers // (pp * vpp)
        start = (chunk * pp + pp_rank) * per
        return list(range(start, start + per))
    sizes = stage_sizes(num_layers, pp, first, last)
    start = sum(sizes[:pp_rank])
    return list(range(start, start + sizes[pp_rank]))

"""Which decoder layers each pipeline stage and model chunk holds, and this rank's model chunks.

Stages are even by default; `first`/`last` give the first or last stage its own count and the rest is
split evenly. With v virtual stages per rank (interleaving), the layers form pp*v equal virtual stages
and model chunk c on pipeline rank r holds virtual stage c*pp + r.
"""
from __future__ import annotations

from typing import Optional

from engine.model import GPTModel


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


def neighbours(stage: int, pp: int, vpp: int) -> tuple:
    """(previous, next) virtual stage of virtual stage `stage`, each as (pipeline rank, model chunk), or None
    past either end of the pipeline."""
    last = pp * vpp - 1
    previous = ((stage - 1) % pp, (stage - 1) // pp) if stage > 0 else None
    following = ((stage + 1) % pp, (stage + 1) // pp) if stage < last else None
    return previous, following


def build_model_chunks(cfg, ctx, *, vocab_size: Optional[int] = None, device=None, dtype=None) -> list:
    """This rank's model chunks (one per virtual pipeline stage) from the run config.

    `vocab_size` defaults to the resolved config's; a checkpoint's own (saved) size overrides it."""
    m, par = cfg.model, cfg.parallel
    chunks = []
    for c in range(ctx.vpp_size):
        ids = stage_layers(m.num_layers, ctx.pp_size, ctx.vpp_size, ctx.pp_rank, c,
                           par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)
        chunks.append(GPTModel(m, ctx, layers=ids, pre_process=ctx.is_first_stage and c == 0,
                               post_process=ctx.is_last_stage and c == ctx.vpp_size - 1, vocab_size=vocab_size,
                               z_loss_weight=cfg.optim.z_loss_weight, seed=cfg.training.seed, device=device,
                               dtype=dtype))
    return chunks

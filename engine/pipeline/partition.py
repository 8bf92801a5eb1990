"""Which decoder layers each pipeline stage and model chunk holds, and this rank's model chunks.

Stages are even by default; `first`/`last` give the first or last stage its own count and the rest is
split evenly. With v virtual stages per rank, the layers form pp*v equal virtual stages. Interleaving
places them round-robin: model chunk c on pipeline rank r holds virtual stage c*pp + r. ZB-V's V
(`v_shape`, two chunks per rank; Qi et al. 2024, sec. 4) sends chunk 0 down the ranks and chunk 1 back
up: rank r holds stages r and 2pp-1-r, so rank 0 holds both the embedding and the loss, and rank pp-1
passes stage pp-1's output to stage pp without leaving the rank.
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


def stage_of(pp: int, vpp: int, pp_rank: int, chunk: int, v_shape: bool = False) -> int:
    """The virtual stage model chunk `chunk` on pipeline rank `pp_rank` holds."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def place(stage: int, pp: int, vpp: int, v_shape: bool = False) -> tuple:
    """(pipeline rank, model chunk) that holds virtual stage `stage`; the inverse of `stage_of`."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, chunk: int,
                 first: Optional[int] = None, last: Optional[int] = None, v_shape: bool = False) -> list:
    """Global ids of the layers in model chunk `chunk` on pipeline rank `pp_rank`."""
    if vpp > 1:
        per = num_layers // (pp * vpp)
        start = stage_of(pp, vpp, pp_rank, chunk, v_shape) * per
        return list(range(start, start + per))
    sizes = stage_sizes(num_layers, pp, first, last)
    start = sum(sizes[:pp_rank])
    return list(range(start, start + sizes[pp_rank]))


def neighbours(stage: int, pp: int, vpp: int, v_shape: bool = False) -> tuple:
    """(previous, next) virtual stage of virtual stage `stage`, each as (pipeline rank, model chunk), or None
    past either end of the pipeline."""
    last = pp * vpp - 1
    previous = place(stage - 1, pp, vpp, v_shape) if stage > 0 else None
    following = place(stage + 1, pp, vpp, v_shape) if stage < last else None
    return previous, following


def build_model_chunks(cfg, ctx, *, vocab_size: Optional[int] = None, device=None, dtype=None) -> list:
    """This rank's model chunks (one per virtual pipeline stage) from the run config.

    `vocab_size` defaults to the resolved config's; a checkpoint's own (saved) size overrides it."""
    m, par = cfg.model, cfg.parallel
    v_shape = cfg.pipeline_schedule == "zb-v"
    chunks = []
    for c in range(ctx.vpp_size):
        ids = stage_layers(m.num_layers, ctx.pp_size, ctx.vpp_size, ctx.pp_rank, c,
                           par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers, v_shape)
        stage = stage_of(ctx.pp_size, ctx.vpp_size, ctx.pp_rank, c, v_shape)
        chunks.append(GPTModel(m, ctx, layers=ids, pre_process=stage == 0,
                               post_process=stage == ctx.pp_size * ctx.vpp_size - 1, vocab_size=vocab_size,
                               z_loss_weight=cfg.optim.z_loss_weight, seed=cfg.training.seed, device=device,
                               dtype=dtype))
    return chunks

"""This rank's model chunks: one per virtual pipeline stage it holds, each with the layers the layout gives it.

Which layers a chunk holds and which stage it is are the layout's (engine.layout: even stages, or a given
first/last stage; with several chunks per rank, equal virtual stages placed round-robin or in ZB-V's V). The
chunk holding stage 0 embeds (`pre_process`), the one holding the last stage computes the loss
(`post_process`): under the V both are on rank 0.
"""
from __future__ import annotations

from typing import Optional

from engine import fp8
from engine.fp8.scaling import Recipe
from engine.model import GPTModel


def build_model_chunks(cfg, ctx, *, vocab_size: Optional[int] = None, device=None, dtype=None) -> list:
    """This rank's model chunks (one per virtual pipeline stage) for the run config and the context's layout.

    `vocab_size` defaults to the resolved config's; a checkpoint's own (saved) size overrides it."""
    layout, m = ctx.layout, cfg.model
    chunks = []
    for c in range(layout.vpp):
        stage = layout.schedule.stage_of(ctx.pp_rank, c)
        chunks.append(GPTModel(m, ctx, layers=layout.layer_ids(m.num_layers, ctx.pp_rank, c), pre_process=stage == 0,
                               post_process=stage == layout.schedule.stages - 1, vocab_size=vocab_size,
                               z_loss_weight=cfg.optim.z_loss_weight, seed=cfg.training.seed, device=device,
                               dtype=dtype))
        fp8.attach(chunks[-1], Recipe.of(cfg.training), ctx, output_layer=cfg.training.fp8_output_layer)
    return chunks


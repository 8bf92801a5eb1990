"""Check the planner's analytic parameter counts against the model the engine really builds.

Every pipeline rank's model chunks are built with the trainer's own `build_model_chunks` on the meta
device (shapes only, no memory, no process group) and their distinct parameters are counted.
"""
from __future__ import annotations

from engine.config import Config
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.planner.memory import Layout, params_per_rank


def meta_params_per_rank(cfg: Config, layout: Layout) -> list:
    """Parameters held by each pipeline rank (tensor- and expert-parallel rank 0) of the model built on meta."""
    par = cfg.parallel
    saved = (par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)
    par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers = \
        layout.first_stage_layers, layout.last_stage_layers
    try:
        counts = []
        for r in range(layout.pp):
            # Expert ranks are carved from dp: dp = ep is the smallest grid holding them; every ep rank holds
            # the same number of experts (E/ep), so ep rank 0 stands for all.
            ctx = ParallelContext.virtual(tp=layout.tp, pp=layout.pp, dp=layout.ep, vpp=layout.vpp, pp_rank=r,
                                          sequence_parallel=layout.sequence_parallel, ep=layout.ep)
            chunks = build_model_chunks(cfg, ctx, device="meta")
            unique = {id(p): p.numel() for chunk in chunks for p in chunk.parameters()}
            counts.append(sum(unique.values()))
        return counts
    finally:
        par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers = saved


def verify(cfg: Config, layout: Layout) -> tuple:
    """(ok, report lines): analytic and meta-device parameter counts per pipeline rank."""
    analytic = params_per_rank(cfg.model, layout)
    built = meta_params_per_rank(cfg, layout)
    ep = f" ep {layout.ep}" if layout.ep > 1 else ""
    lines = [f"tp {layout.tp} pp {layout.pp} vpp {layout.vpp}{ep}: parameters per GPU (tp rank 0)",
             f"{'pp rank':>8} {'analytic':>15} {'meta device':>15}  match"]
    for r, (a, b) in enumerate(zip(analytic, built)):
        lines.append(f"{r:>8} {a:>15,} {b:>15,}  {'yes' if a == b else 'NO'}")
    return analytic == built, lines

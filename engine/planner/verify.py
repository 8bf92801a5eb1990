"""Check the planner's analytic parameter counts against the model the engine really builds.

Every pipeline rank's model chunks are built with the trainer's own `build_model_chunks` on the meta
device (shapes only, no memory, no process group) and their distinct parameters are counted.
"""
from __future__ import annotations

import dataclasses

from engine.config import Config
from engine.layout import Layout
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.planner.params import params_per_rank


def meta_params_per_rank(cfg: Config, layout: Layout) -> list:
    """Parameters held by each pipeline rank (tensor- and expert-parallel rank 0) of the model built on meta."""
    # Expert ranks are carved from dp: dp = ep is the smallest grid holding them; every ep rank holds the same
    # number of experts (E/ep), so ep rank 0 stands for all. Parameters do not depend on cp.
    grid = dataclasses.replace(layout, dp=layout.ep, cp=1)
    counts = []
    for r in range(layout.pp):
        chunks = build_model_chunks(cfg, ParallelContext.virtual(layout=grid, pp_rank=r), device="meta")
        counts.append(sum({id(p): p.numel() for chunk in chunks for p in chunk.parameters()}.values()))
    return counts


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

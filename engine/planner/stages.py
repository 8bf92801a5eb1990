"""Which layers each pipeline rank holds, and which ranks hold the two ends, for a layout the planner rates.

The engine's own split (Layout.layer_ids, engine.pipeline.partition) answered per (pipeline rank, model chunk)
and cached: the planner asks it for every layout of a search, and a search meets few distinct splits.
"""
from __future__ import annotations

import functools
from typing import Optional

from engine.config import ModelConfig
from engine.layout import Layout, PipelineSchedule


def stage_layer_ids(num_layers: int, layout: Layout) -> tuple:
    """Global layer ids per (pipeline rank, model chunk): the engine's own split (engine.pipeline.partition).

    Uneven first/last stages with an interleaved schedule (the engine does not run it; Llama 3 405B did)
    split each rank's layers over its chunks as evenly as they go, for evaluating published layouts. ZB-V's V
    puts chunk 1 of rank r on stage 2pp-1-r."""
    return _stage_ids(num_layers, layout.schedule, layout.first_stage_layers, layout.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_ids(num_layers: int, schedule: PipelineSchedule, first: Optional[int], last: Optional[int]) -> tuple:
    pp, vpp = schedule.pp, schedule.vpp
    if (first is not None or last is not None) and vpp > 1:
        split = Layout(pp=pp, first_stage_layers=first, last_stage_layers=last)
        out = []
        for r in range(pp):
            ids = tuple(split.layer_ids(num_layers, r, 0))
            sizes = [len(ids) // vpp + (c < len(ids) % vpp) for c in range(vpp)]
            out.append(tuple(ids[sum(sizes[:c]):sum(sizes[:c + 1])] for c in range(vpp)))
        return tuple(out)
    split = Layout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last, pipeline_schedule=schedule.name)
    return tuple(tuple(tuple(split.layer_ids(num_layers, r, c)) for c in range(vpp)) for r in range(pp))


def stage_layer_counts(num_layers: int, layout: Layout) -> tuple:
    """Layers per (pipeline rank, model chunk), see stage_layer_ids."""
    return _stage_counts(num_layers, layout.schedule, layout.first_stage_layers, layout.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_counts(num_layers: int, schedule: PipelineSchedule, first: Optional[int], last: Optional[int]) -> tuple:
    return tuple(tuple(len(ids) for ids in chunks) for chunks in _stage_ids(num_layers, schedule, first, last))


def end_ranks(layout: Layout) -> tuple:
    """(pipeline rank with the embedding, pipeline rank with the output layer): ZB-V's V puts both on rank 0."""
    return 0, layout.schedule.loss_rank


def moe_layers_per_rank(model: ModelConfig, layout: Layout) -> list:
    """MoE layers held by each pipeline rank."""
    if not model.num_experts:
        return [0] * layout.pp
    moe = set(model.moe_layers())
    return [sum(i in moe for ids in chunks for i in ids) for chunks in stage_layer_ids(model.num_layers, layout)]

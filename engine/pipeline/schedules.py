"""Pipeline schedules: one ordered list of (F|B, chunk, microbatch) per rank, executed or simulated.

No pipelining (pp 1): forward and backward of each microbatch in turn (gradient accumulation).
1F1B (Narayanan et al. 2021, "PipeDream-Flush"): rank r runs pp-r-1 warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most pp-r
microbatches' activations.
Interleaved 1F1B (same paper, sec. 2.2): each rank holds v model chunks; virtual microbatch k runs on
chunk (k mod pp*v) // pp for microbatch (k // (pp*v))*pp + k mod pp, backwards in mirrored chunk order,
with (pp-r-1)*2 + (v-1)*pp warm-up forwards. Microbatches must be a multiple of pp. A rank holds at
most warm-up + 1 virtual microbatches' activations (asserted in the tests).

Zero-bubble schedules (ZB-H1, ZB-V; engine.pipeline.zero_bubble) split each backward into B (input
gradient) and W (weight gradients): their operations are ("F" | "B" | "W", chunk, microbatch), and ZB-V
runs two chunks per rank in a V. Every function takes the schedule as the layout's value
(engine.layout.PipelineSchedule: name, pp, chunks per rank, placement).

The same order drives `runner.PipelineRunner` (real tensors) and `simulate` (given costs), so the bubble
the simulator reports is the bubble of the schedule that trains. A zero-bubble order depends on the costs
it is built for (`costs`, a zero_bubble.Costs): the runner and the planner pass the model's
(engine.flops.split_backward_costs), the simulator the costs it replays.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

from engine.flops import UNIT, Costs
from engine.layout import PipelineSchedule
from engine.pipeline import zero_bubble
from engine.pipeline.replay import makespan, max_in_flight, replay, steady_period
from engine.validation import check_interleaved_microbatches


def check_schedule(schedule: PipelineSchedule, num_microbatches: int) -> None:
    """Reject impossible settings before any work; warn about wasteful ones."""
    pp = schedule.pp
    if schedule.interleaved:
        check_interleaved_microbatches(pp, schedule.vpp, num_microbatches)  # validate's rule for the batch flags
    if pp > 1 and num_microbatches < pp:
        warnings.warn(f"{num_microbatches} microbatches for {pp} pipeline stages: most stages will idle; "
                      f"use at least {pp} microbatches per step", stacklevel=2)


def warmup_count(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    """Forwards rank `rank` runs before its first backward."""
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - rank - 1, total)
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def peak_in_flight(schedule: PipelineSchedule, rank: int, num_microbatches: int, costs: Costs = UNIT) -> int:
    """Model-chunk forwards whose activations rank `rank` holds at its peak: the warm-up and one more, at
    most every forward of the step; the planner's activation count. For 1F1B that is pp - rank; for the
    interleaved schedule 2(pp - rank - 1) + (vpp - 1)pp + 1 chunks, which on rank 0 is Korthikanti et al.'s
    factor 1 + (pp - 1)/(pp vpp) in units of the rank's layers. Zero-bubble schedules: counted on their
    order, up to the W pass (the stores W needs count as held activations)."""
    if schedule.split_backward:
        return max_in_flight(schedule_order(schedule, rank, num_microbatches, costs), until="W")
    vpp = schedule.vpp
    return min(warmup_count(schedule.pp, vpp, rank, num_microbatches) + 1, num_microbatches * vpp)


def _virtual(k: int, pp: int, vpp: int, forward: bool) -> tuple:
    if vpp == 1:
        return 0, k
    group, pos = divmod(k, pp * vpp)
    chunk = pos // pp
    return (chunk if forward else vpp - 1 - chunk), group * pp + pos % pp


def schedule_steps(schedule: PipelineSchedule, rank: int, num_microbatches: int, forward_only: bool = False,
                   costs: Costs = UNIT) -> list:
    """This rank's operations, ("F" | "B" | "W", chunk, microbatch), grouped into the steps between two exchanges.

    Every operation is a step of its own, except in the interleaved schedule's steady state, where a
    forward and the backward after it form one step (see engine.pipeline.p2p.exchange_plan); forward-only
    runs (evaluation) take every forward alone.
    """
    if schedule.split_backward:
        return [[op] for op in zero_bubble.orders(schedule, num_microbatches, forward_only, costs)[rank]]
    pp, vpp = schedule.pp, schedule.vpp
    total = num_microbatches * vpp
    fwd = [("F", *_virtual(k, pp, vpp, True)) for k in range(total)]
    if forward_only:
        return [[op] for op in fwd]
    warm = warmup_count(pp, vpp, rank, num_microbatches)
    bwd = [("B", *_virtual(k, pp, vpp, False)) for k in range(total)]
    pairs = [[fwd[warm + j], bwd[j]] for j in range(total - warm)]
    steady = pairs if vpp > 1 else [[op] for pair in pairs for op in pair]
    return [[op] for op in fwd[:warm]] + steady + [[op] for op in bwd[total - warm:]]


def schedule_order(schedule: PipelineSchedule, rank: int, num_microbatches: int, costs: Costs = UNIT) -> list:
    """This rank's operations in execution order: ("F" | "B" | "W", chunk, microbatch)."""
    return [op for step in schedule_steps(schedule, rank, num_microbatches, costs=costs) for op in step]


def simulate(schedule: PipelineSchedule, num_microbatches: int, t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float = 0.0, built_for: Optional[Costs] = None) -> dict:
    """Replay every rank's order with per-chunk costs t/vpp and free communication (engine.pipeline.replay).

    `t_backward` is the input-gradient part of a backward and `t_weight` the weight-gradient part: one
    backward operation costs both in 1F1B and interleaving, a B and a W of a split backward one each (whose
    order is the one built for `built_for`, by default these costs). Returns
    - makespan: one step alone, every rank starting together (a step that waits for all ranks before the next);
    - ideal: one stage's work, m*(tf+tb+tw), and bubble = (makespan - ideal) / ideal;
    - period: the time per step once steps run back to back (`replay.steady_period`), which is how the
      zero-bubble schedules run (their optimizer steps without a pipeline-wide barrier:
      engine.optim.post_validation), and steady_bubble = (period - ideal) / ideal. For 1F1B and interleaving,
      whose first rank starts first and ends last, the period is the makespan.
    """
    vpp = schedule.vpp
    costs = built_for or Costs(t_forward, t_backward, t_weight)
    orders = [schedule_order(schedule, r, num_microbatches, costs) for r in range(schedule.pp)]
    cost = {"F": t_forward / vpp, "B": (t_backward + (0.0 if schedule.split_backward else t_weight)) / vpp,
            "W": t_weight / vpp}
    ideal = num_microbatches * (t_forward + t_backward + t_weight)
    span = makespan(replay(orders, schedule, cost))
    period = steady_period(orders, schedule, cost, num_microbatches)
    return {"makespan": span, "ideal": ideal, "bubble": (span - ideal) / ideal, "period": period,
            "steady_bubble": (period - ideal) / ideal}


@functools.lru_cache(maxsize=256)
def bubble_time(schedule: PipelineSchedule, num_microbatches: int, t_forward: float, t_backward: float,
                t_weight: float, built_for: Optional[Costs] = None) -> float:
    """Idle time per step for the given per-stage costs, the planner's bubble: period - ideal, the steps
    running back to back as the engine runs them (for 1F1B and interleaving the same as makespan - ideal).
    Past 3pp microbatches the bubble no longer grows, so longer steps are replayed at that length."""
    m = min(num_microbatches, 3 * schedule.pp)
    sim = simulate(schedule, m, t_forward, t_backward, t_weight, built_for)
    return sim["period"] - sim["ideal"]

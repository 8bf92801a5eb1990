"""Pipeline schedules: one ordered list of (F|B, chunk, microbatch) per rank, executed or simulated.

No pipelining (pp 1): forward and backward of each microbatch in turn (gradient accumulation).
1F1B (Narayanan et al. 2021, "PipeDream-Flush"): rank r runs pp-r-1 warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most pp-r
microbatches' activations.
Interleaved 1F1B (same paper, sec. 2.2): each rank holds v model chunks; virtual microbatch k runs on
chunk (k mod pp*v) // pp for microbatch (k // (pp*v))*pp + k mod pp, backwards in mirrored chunk order,
with (pp-r-1)*2 + (v-1)*pp warm-up forwards. Microbatches must be a multiple of pp. A rank holds at
most warm-up + 1 virtual microbatches' activations (asserted in the tests).

The same order drives `runner.PipelineRunner` (real tensors) and `simulate` (unit costs), so the bubble
the simulator reports is the bubble of the schedule that trains.
"""
from __future__ import annotations

import warnings

from engine.config import check_interleaved_microbatches
from engine.pipeline.partition import neighbours


def check_schedule(pp: int, vpp: int, num_microbatches: int) -> None:
    """Reject impossible settings before any work; warn about wasteful ones."""
    check_interleaved_microbatches(pp, vpp, num_microbatches)  # validate's rule for the batch flags
    if pp > 1 and num_microbatches < pp:
        warnings.warn(f"{num_microbatches} microbatches for {pp} pipeline stages: most stages will idle; "
                      f"use at least {pp} microbatches per step", stacklevel=2)


def warmup_count(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    """Forwards rank `rank` runs before its first backward."""
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - rank - 1, total)
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def peak_in_flight(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    """Model-chunk forwards whose activations rank `rank` holds at its peak: the warm-up and one more, at
    most every forward of the step; the planner's activation count. For 1F1B that is pp - rank; for the
    interleaved schedule 2(pp - rank - 1) + (vpp - 1)pp + 1 chunks, which on rank 0 is Korthikanti et al.'s
    factor 1 + (pp - 1)/(pp vpp) in units of the rank's layers."""
    return min(warmup_count(pp, vpp, rank, num_microbatches) + 1, num_microbatches * vpp)


def _virtual(k: int, pp: int, vpp: int, forward: bool) -> tuple:
    if vpp == 1:
        return 0, k
    group, pos = divmod(k, pp * vpp)
    chunk = pos // pp
    return (chunk if forward else vpp - 1 - chunk), group * pp + pos % pp


def schedule_steps(pp: int, vpp: int, rank: int, num_microbatches: int, forward_only: bool = False) -> list:
    """This rank's operations, ("F" | "B", chunk, microbatch), grouped into the steps between two exchanges.

    Every operation is a step of its own, except in the interleaved schedule's steady state, where a
    forward and the backward after it form one step (see engine.pipeline.p2p.exchange_plan); forward-only
    runs (evaluation) take every forward alone.
    """
    total = num_microbatches * vpp
    fwd = [("F", *_virtual(k, pp, vpp, True)) for k in range(total)]
    if forward_only:
        return [[op] for op in fwd]
    warm = warmup_count(pp, vpp, rank, num_microbatches)
    bwd = [("B", *_virtual(k, pp, vpp, False)) for k in range(total)]
    pairs = [[fwd[warm + j], bwd[j]] for j in range(total - warm)]
    steady = pairs if vpp > 1 else [[op] for pair in pairs for op in pair]
    return [[op] for op in fwd[:warm]] + steady + [[op] for op in bwd[total - warm:]]


def schedule_order(pp: int, vpp: int, rank: int, num_microbatches: int) -> list:
    """This rank's operations in execution order: ("F" | "B", chunk, microbatch)."""
    return [op for step in schedule_steps(pp, vpp, rank, num_microbatches) for op in step]


def max_in_flight(order: list) -> int:
    """Most microbatch-chunks whose activations are held at once (forward done, backward not)."""
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(pp: int, vpp: int, num_microbatches: int, t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Replay every rank's order with per-chunk costs t/vpp and free communication.

    Returns the makespan, the ideal time (one stage's work, m*(tf+tb)) and the bubble fraction
    (makespan - ideal) / ideal.
    """
    orders = [schedule_order(pp, vpp, r, num_microbatches) for r in range(pp)]
    done, clock, pos = {}, [0.0] * pp, [0] * pp
    cost = {"F": t_forward / vpp, "B": t_backward / vpp}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, c, mb = orders[r][pos[r]]
            dep = _dependency(kind, r, c, mb, pp, vpp)
            if any(d not in done for d in dep):
                continue
            start = max([clock[r]] + [done[d] for d in dep])
            clock[r] = done[(kind, r, c, mb)] = start + cost[kind]
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks")  # a bug in schedule_order, never a user error
    ideal = num_microbatches * (t_forward + t_backward)
    makespan = max(clock)
    return {"makespan": makespan, "ideal": ideal, "bubble": (makespan - ideal) / ideal}


def _dependency(kind, r, c, mb, pp, vpp) -> list:
    """The operations (kind, pp rank, chunk, microbatch) this one waits for."""
    previous, following = neighbours(c * pp + r, pp, vpp)
    if kind == "F":
        return [("F", *previous, mb)] if previous else []
    return [("F", r, c, mb)] + ([("B", *following, mb)] if following else [])


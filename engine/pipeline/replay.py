"""Replaying every rank's pipeline order with given operation costs: when each operation starts and ends.

Communication is free. An operation starts as soon as its rank is free and what it waits for has ended: a
forward waits for the same microbatch's forward on the previous virtual stage; a backward (or a split
backward's B) for its own forward and the same microbatch's backward on the next virtual stage; a W for its
B. The pipeline simulator (engine.pipeline.schedules.simulate) reports these times; the zero-bubble orders
(engine.pipeline.zero_bubble) pick among candidate orders by them and post their messages in their order.
"""
from __future__ import annotations

from engine.layout import PipelineSchedule


def replay(orders: list, schedule: PipelineSchedule, cost: dict) -> dict:
    """{(kind, pp rank, chunk, microbatch): (start, end)} for `orders` (one list of (kind, chunk, microbatch)
    per pp rank of `schedule`), each operation costing cost[kind]."""
    pp = len(orders)
    times, clock, pos = {}, [0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, c, mb = orders[r][pos[r]]
            waits = dependencies(kind, r, c, mb, schedule)
            if any(d not in times for d in waits):
                continue
            start = max([clock[r]] + [times[d][1] for d in waits])
            clock[r] = start + cost[kind]
            times[(kind, r, c, mb)] = (start, clock[r])
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline order deadlocks")  # a bug in the schedule, never a user error
    return times


def makespan(times: dict):
    return max(end for _, end in times.values())


def steady_period(orders: list, schedule: PipelineSchedule, cost: dict, num_microbatches: int,
                  steps: int = 3) -> float:
    """Time from the end of one training step to the end of the next once steps run back to back: every rank
    runs its order `steps` times over, starting its next step as soon as its own operations of this one are
    done (its optimizer step needs no other rank's: engine.optim.post_validation), the microbatches of each
    step numbered after the last's. For an order whose first rank starts first and ends last (1F1B,
    interleaving) this is the makespan; for one whose ranks end as much later as they start (a
    parallelogram) it is one rank's work. The last step's increment is returned: the first steps may still be
    settling."""
    m = num_microbatches
    chained = [[(kind, c, mb + s * m) for s in range(steps) for kind, c, mb in order] for order in orders]
    ends = [0.0] * steps
    for (_, _, _, mb), (_, end) in replay(chained, schedule, cost).items():
        ends[mb // m] = max(ends[mb // m], end)
    return ends[-1] - ends[-2]


def dependencies(kind: str, r: int, c: int, mb: int, schedule: PipelineSchedule) -> list:
    """The operations (kind, pp rank, chunk, microbatch) this one waits for."""
    if kind == "W":
        return [("B", r, c, mb)]
    previous, following = schedule.neighbours(schedule.stage_of(r, c))
    if kind == "F":
        return [("F", *previous, mb)] if previous else []
    return [("F", r, c, mb)] + ([("B", *following, mb)] if following else [])


def max_in_flight(order: list, until: str = "B") -> int:
    """Most microbatch-chunks whose activations are held at once: forward done, backward (B) not; with
    until="W", counted up to the W pass of a split backward (what W keeps counts as held)."""
    closing = "W" if until == "W" and any(kind == "W" for kind, _, _ in order) else "B"
    live = peak = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1 if kind == closing else 0
        peak = max(peak, live)
    return peak

"""Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): ZB-H1 and ZB-V.

Each backward is split in two: B, the input gradient, which the previous stage waits for, and W, the
weight gradients, which nothing waits for and which can therefore fill the time a rank would otherwise
idle (engine.parallel.mappings defers them). The orders are built here by list scheduling: time advances
from one event to the next, and every rank, when it is free, takes of the operations whose inputs are
ready a forward (the later stage first) if its memory allows one more, else an input-gradient backward
(the later stage first), else its oldest deferred W, else idles until something changes. Memory is
counted in model-chunk microbatches:

- ZB-H1 (one chunk per rank): rank r holds at most pp - r microbatches' activations (forward done, B not
  yet: 1F1B's count on that rank) and at most pp counting the stores W still needs (1F1B's peak, rank 0's).
  With F = B = W the bubble is (p - 1) F, a third of 1F1B's (p - 1)(F + B + W).
- ZB-V (two chunks per rank in a V, engine.pipeline.partition): activations of at most 2 pp chunk-microbatches,
  i.e. pp microbatches of the rank's layers, 1F1B's peak; with the stores W still needs, 2 pp, or 3 pp in
  the "roomy" candidates below, which buy the zero bubble.

Bubbles, F = B = W, p 8, m 32 (tests/test_zero_bubble.py). Steps run back to back (the engine's optimizer
steps without a pipeline-wide barrier under these schedules: engine.optim.post_validation), so the bubble
is the period per step less one rank's work (replay.steady_period). ZB-H1: (p - 1) F, a third of 1F1B's
(p - 1)(F + B + W). ZB-V: zero with the roomy cap: each rank is busy from its first operation to its last,
and the last rank, which cannot start before the first microbatch has passed p - 1 half-stages, ends that
much later than the first (a parallelogram). One step alone behind a barrier would keep those (p - 1) F / 2.

Operation costs (`Costs`: forward, B and W of one stage and microbatch; engine.flops.
split_backward_costs derives them from the model) decide when inputs are ready, so they shape the order.
Candidate orders are built as if F = B = W and for the given costs (rounded to eighths of the forward),
each taking a ready forward before a ready B or the other way round, and for ZB-V with either cap on the
W stores (a candidate that runs into its caps with nothing ready is dropped). The one with the shortest
period at the given costs is used, then the one holding least, then the shortest single step (the first on
a tie). Orders built for equal costs alone do badly when B and W differ: at p 8, m 32 with F = 1, B = 1.5,
W = 0.5, ZB-V's bubble is 1.9x 1F1B's; built for those costs it is 0.35x. The chosen order is what runs
with real tensors, what the simulator (engine.pipeline.schedules.simulate) replays and what the exchange
plan posts messages by (`timeline`).
"""
from __future__ import annotations

import functools
import heapq
import math
from collections import deque

from engine.flops import UNIT, Costs
from engine.layout import PipelineSchedule
from engine.pipeline.replay import makespan, max_in_flight, replay, steady_period

TICKS = 8  # costs are rounded to eighths of the forward's


def ticks(costs: Costs) -> tuple:
    """The costs in whole eighths of the forward's, at least one each (positive times keep a rank's operations
    at distinct times, which the exchange plan's slots need)."""
    if not (costs.forward > 0 and all(0 <= c < math.inf for c in costs)):
        raise ValueError(f"zero-bubble costs need a positive forward and finite B and W, got {tuple(costs)}")
    return tuple(max(1, round(TICKS * c / costs.forward)) for c in costs)


class _Rank:
    """One rank's state while the orders are built."""

    def __init__(self, stages: list, caps: tuple):
        self.stages, self.caps = stages, caps
        self.activations = 0   # forwards whose B has not run
        self.held = 0          # forwards whose W has not run (activations and weight-gradient stores)
        self.waiting_w = deque()
        self.order: list = []

    def may_forward(self, forward_only: bool) -> bool:
        return forward_only or (self.activations < self.caps[0] and self.held < self.caps[1])


def _caps(schedule: PipelineSchedule, rank: int, roomy: bool) -> tuple:
    """(activations, activations + W stores) rank `rank` may hold, in model-chunk microbatches; `roomy`: ZB-V
    keeps up to pp more W stores."""
    pp = schedule.pp
    return (2 * pp, (3 if roomy else 2) * pp) if schedule.v_shape else (pp - rank, pp)


def orders(schedule: PipelineSchedule, num_microbatches: int, forward_only: bool = False, costs: Costs = UNIT) -> tuple:
    """Every pipeline rank's operations ("F" | "B" | "W", chunk, microbatch) in execution order."""
    return _build(schedule, num_microbatches, forward_only, ticks(costs))[0]


def timeline(schedule: PipelineSchedule, num_microbatches: int, forward_only: bool = False,
             costs: Costs = UNIT) -> dict:
    """{(kind, virtual stage, microbatch): the slot it starts in}: slots number the distinct start times of the
    order's replay at `costs` (engine.pipeline.p2p posts each message at the slot of the operation that needs
    it). Read only: it is cached."""
    return _build(schedule, num_microbatches, forward_only, ticks(costs))[1]


@functools.lru_cache(maxsize=128)
def _build(schedule: PipelineSchedule, m: int, forward_only: bool, cost_ticks: tuple) -> tuple:
    assert schedule.split_backward, schedule
    cost = dict(zip("FBW", cost_ticks))
    candidates = [(c, b, roomy) for c in ((1, 1, 1), cost_ticks) for b in (False, True)
                  for roomy in (False, schedule.v_shape)]
    built = [o for o in dict.fromkeys(_list_schedule(schedule, m, forward_only, *c) for c in candidates) if o]
    if not built:
        raise RuntimeError(f"{schedule.name} cannot be scheduled for pp {schedule.pp}, {m} microbatches")  # a bug
    replayed = [replay(o, schedule, cost) for o in built]

    def merit(i: int) -> tuple:  # steady-state period, then held memory, then one step's makespan
        period = 0 if forward_only else steady_period(built[i], schedule, cost, m)
        return period, max(max_in_flight(o, until="W") for o in built[i]), makespan(replayed[i])
    best = min(range(len(built)), key=merit)  # the first on a tie
    slot = {t: i for i, t in enumerate(sorted({start for start, _ in replayed[best].values()}))}
    return built[best], {(kind, schedule.stage_of(r, c), mb): slot[start]
                         for (kind, r, c, mb), (start, _) in replayed[best].items()}


def _list_schedule(schedule: PipelineSchedule, m: int, forward_only: bool, cost_ticks: tuple, b_first: bool,
                   roomy: bool) -> tuple:
    """Every rank's order by list scheduling with these costs (see the module doc); `b_first`: a ready B goes
    before a forward."""
    pp, vpp, cost = schedule.pp, schedule.vpp, dict(zip("FBW", cost_ticks))
    ranks = [_Rank([schedule.stage_of(r, c) for c in range(vpp)], _caps(schedule, r, roomy)) for r in range(pp)]
    ends: dict = {}  # (kind, stage, microbatch) -> when it ends
    events, clock = [], [0] * pp  # end times still ahead; when each rank is next free
    next_f, next_b = [0] * (pp * vpp), [0] * (pp * vpp)
    left = pp * vpp * m * (1 if forward_only else 3)
    while left:
        t = min(clock)
        for r, rank in enumerate(ranks):
            op = _choose(rank, t, ends, next_f, next_b, pp * vpp - 1, m, forward_only, b_first) \
                if clock[r] == t else None
            if op is not None:
                ends[op] = clock[r] = t + cost[op[0]]
                heapq.heappush(events, clock[r])
                rank.order.append((op[0], schedule.place(op[1])[1], op[2]))
                left -= 1
        while events and events[0] <= t:
            heapq.heappop(events)
        later = [c for c in clock if c > t] + events[:1]
        if left and not later:  # every rank at its memory caps with nothing else ready
            return None
        clock = [c if c > t else min(later, default=t) for c in clock]  # idle ranks wait for the next event
    return tuple(tuple(rank.order) for rank in ranks)


def _choose(rank: _Rank, t: int, ends: dict, next_f: list, next_b: list, last: int, m: int,
            forward_only: bool, b_first: bool):
    """The operation (kind, stage, microbatch) `rank` runs at time `t`, or None (it idles); updates its state."""
    done = lambda *op: ends.get(op, math.inf) <= t  # noqa: E731 - ended by now
    if b_first and not forward_only and (op := _ready_b(rank, done, next_b, last, m)):
        return op
    if rank.may_forward(forward_only):
        for s in sorted(rank.stages, reverse=True):
            k = next_f[s]
            if k < m and (s == 0 or done("F", s - 1, k)):
                next_f[s] += 1
                rank.activations, rank.held = rank.activations + 1, rank.held + 1
                return "F", s, k
    if forward_only:
        return None
    if op := _ready_b(rank, done, next_b, last, m):
        return op
    if rank.waiting_w:
        rank.held -= 1
        return ("W", *rank.waiting_w.popleft())
    return None


def _ready_b(rank: _Rank, done, next_b: list, last: int, m: int):
    """The input-gradient backward `rank` can run now (the later stage first), taken; or None."""
    for s in sorted(rank.stages, reverse=True):
        k = next_b[s]
        if k < m and done("F", s, k) and (s == last or done("B", s + 1, k)):
            next_b[s] += 1
            rank.activations -= 1
            rank.waiting_w.append((s, k))
            return "B", s, k
    return None

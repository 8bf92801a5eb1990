"""Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): ZB-H1 and ZB-V.

Each backward is split in two: B, the input gradient, which the previous stage waits for, and W, the
weight gradients, which nothing waits for and which can therefore fill the time a rank would otherwise
idle (engine.parallel.mappings defers them). The orders are built here by list scheduling on unit-cost
operations: time advances one operation at a time, and every rank, when it is free, takes of the
operations whose inputs are ready a forward (the later stage first) if its memory allows one more, else
an input-gradient backward (the later stage first), else its oldest deferred W, else idles. Memory is
counted in model-chunk microbatches:

- ZB-H1 (one chunk per rank): rank r holds at most pp - r microbatches' activations (forward done, B not
  yet: 1F1B's count on that rank) and at most pp counting the stores W still needs (1F1B's peak, rank 0's).
  With F = B = W the bubble is (p - 1) F, a third of 1F1B's (p - 1)(F + B + W).
- ZB-V (two chunks per rank in a V, engine.pipeline.partition): at most 2 pp chunk-microbatches either way,
  i.e. pp microbatches of the rank's layers, 1F1B's peak. Its bubble is (p - 1) F / 2 with F = B = W: the
  last rank cannot start before the first microbatch has passed p - 1 half-stages, and it has a full
  share of work after that (no placement of two chunks per rank does better), a sixth of 1F1B's.

The unit-cost orders are what runs with real tensors and what the simulator (engine.pipeline.schedules.
simulate) replays with other F, B, W costs.
"""
from __future__ import annotations

import functools
from collections import deque

from engine.pipeline.partition import place, stage_of

SCHEDULES = ("zb-h1", "zb-v")


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


def _caps(schedule: str, pp: int, rank: int) -> tuple:
    """(activations, activations + W stores) rank `rank` may hold, in model-chunk microbatches."""
    return (2 * pp, 2 * pp) if schedule == "zb-v" else (pp - rank, pp)


def orders(schedule: str, pp: int, num_microbatches: int, forward_only: bool = False) -> tuple:
    """Every pipeline rank's operations ("F" | "B" | "W", chunk, microbatch) in execution order."""
    return _build(schedule, pp, num_microbatches, forward_only)[0]


def timeline(schedule: str, pp: int, num_microbatches: int, forward_only: bool = False) -> dict:
    """{(kind, virtual stage, microbatch): the unit-time slot it was scheduled in} (engine.pipeline.p2p posts
    each message at the slot of the operation that needs it). Read only: it is cached."""
    return _build(schedule, pp, num_microbatches, forward_only)[1]


@functools.lru_cache(maxsize=128)
def _build(schedule: str, pp: int, num_microbatches: int, forward_only: bool) -> tuple:
    assert schedule in SCHEDULES, schedule
    v_shape = schedule == "zb-v"
    vpp, m = (2 if v_shape else 1), num_microbatches
    ranks = [_Rank([stage_of(pp, vpp, r, c, v_shape) for c in range(vpp)], _caps(schedule, pp, r))
             for r in range(pp)]
    started: dict = {}  # (kind, stage, microbatch) -> the time step it ran in (it is done one step later)
    next_f, next_b = [0] * (pp * vpp), [0] * (pp * vpp)
    left = pp * vpp * m * (1 if forward_only else 3)
    t = 0
    while left:
        ran = 0
        for rank in ranks:
            op = _choose(rank, t, started, next_f, next_b, pp * vpp - 1, m, forward_only)
            if op is not None:
                kind, stage, mb = op
                started[op] = t
                rank.order.append((kind, place(stage, pp, vpp, v_shape)[1], mb))
                ran += 1
        if not ran:
            raise RuntimeError(f"{schedule} cannot be scheduled for pp {pp}, {m} microbatches")  # a bug here
        left -= ran
        t += 1
    return tuple(tuple(rank.order) for rank in ranks), started


def _choose(rank: _Rank, t: int, started: dict, next_f: list, next_b: list, last: int, m: int,
            forward_only: bool):
    """The operation (kind, stage, microbatch) `rank` runs at step `t`, or None (it idles); updates its state."""
    done = lambda *op: started.get(op, t) < t  # noqa: E731 - ran in an earlier step
    if rank.may_forward(forward_only):
        for s in sorted(rank.stages, reverse=True):
            k = next_f[s]
            if k < m and (s == 0 or done("F", s - 1, k)):
                next_f[s] += 1
                rank.activations, rank.held = rank.activations + 1, rank.held + 1
                return "F", s, k
    if forward_only:
        return None
    for s in sorted(rank.stages, reverse=True):
        k = next_b[s]
        if k < m and done("F", s, k) and (s == last or done("B", s + 1, k)):
            next_b[s] += 1
            rank.activations -= 1
            rank.waiting_w.append((s, k))
            return "B", s, k
    if rank.waiting_w:
        rank.held -= 1
        return ("W", *rank.waiting_w.popleft())
    return None

"""Pipeline schedules: one ordered list of (F|B, chunk, microbatch) per rank, executed or simulated.

No pipelining (pp 1): forward and backward of each microbatch in turn (gradient accumulation).
1F1B (Narayanan et al. 2021, "PipeDream-Flush"): rank r runs pp-r-1 warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most pp-r
microbatches' activations.
Interleaved 1F1B (same paper, sec. 2.2): each rank holds v model chunks; virtual microbatch k runs on
chunk (k mod pp*v) // pp for microbatch (k // (pp*v))*pp + k mod pp, backwards in mirrored chunk order,
with (pp-r-1)*2 + (v-1)*pp warm-up forwards. Microbatches must be a multiple of pp. A rank holds at
most warm-up + 1 virtual microbatches' activations (asserted in the tests).

The same order drives `run` (real tensors) and `simulate` (unit costs), so the bubble the simulator
reports is the bubble of the schedule that trains.
"""
from __future__ import annotations

import time
import warnings

import torch

from engine.config import ConfigError
from engine.parallel import comm
from engine.pipeline.p2p import StageLink, backward_through, exchange_plan


def check_schedule(pp: int, vpp: int, num_microbatches: int) -> None:
    """Reject impossible settings before any work; warn about wasteful ones."""
    if vpp > 1 and num_microbatches % pp:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp}: the interleaved schedule needs the number of "
                          f"microbatches ({num_microbatches}) to be a multiple of pp {pp}; change --global-batch-size "
                          f"or --micro-batch-size")
    if pp > 1 and num_microbatches < pp:
        warnings.warn(f"{num_microbatches} microbatches for {pp} pipeline stages: most stages will idle; "
                      f"use at least {pp} microbatches per step", stacklevel=2)


def warmup_count(pp: int, vpp: int, rank: int, num_microbatches: int) -> int:
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - rank - 1, total)
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


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
    stage = c * pp + r
    last = pp * vpp - 1
    if kind == "F":
        return [] if stage == 0 else [("F", (stage - 1) % pp, (stage - 1) // pp, mb)]
    deps = [("F", r, c, mb)]
    if stage < last:
        deps.append(("B", (stage + 1) % pp, (stage + 1) // pp, mb))
    return deps


def run(chunks, microbatches, ctx, *, shape, dtype, device, forward_only=False, scale_loss=None, trace=None):
    """Forward (and backward) over all microbatches; returns the mean loss, known on every rank.

    `chunks`: this rank's model chunks. `microbatches`: list of dicts (tokens, labels, loss_mask); only
    the first stage reads tokens and only the last reads labels, but every rank gets the same list.
    Losses fed to backward are divided by the number of microbatches; `scale_loss` (fp16) scales them.
    `trace`: a list to append (rank, kind, microbatch, chunk, start, end) events to.
    """
    m = len(microbatches)
    pp, vpp = ctx.pp_size, ctx.vpp_size
    check_schedule(pp, vpp, m)
    steps = schedule_steps(pp, vpp, ctx.pp_rank, m, forward_only)
    link = StageLink(ctx, shape, dtype, device)
    saved, losses, outbox = {}, [], []
    for exchange, ops in exchange_plan(steps, pp, vpp, ctx.pp_rank):
        # what the last step sent, what this step needs (one entry per operation, None if it needs nothing)
        inbox = link.exchange(exchange, outbox)
        outbox = []
        for (kind, c, mb), received in zip(ops, inbox):
            model = chunks[c]
            t0 = time.time()  # inputs have arrived: waiting for them shows as idle time in the trace
            if kind == "F":
                batch = microbatches[mb]
                x = None if received is None else received.requires_grad_()
                out = model(tokens=batch["tokens"], hidden=x, labels=batch.get("labels"),
                            loss_mask=batch.get("loss_mask"))
                if model.post_process:
                    losses.append(out.detach())
                    out = out / m
                    if scale_loss is not None:
                        out = scale_loss(out)
                else:
                    outbox.append(out)
                if not forward_only:
                    saved[(c, mb)] = (x, out)
            else:
                x, out = saved.pop((c, mb))
                if received is None:
                    out.backward()
                else:
                    backward_through(out, received)
                if x is not None:
                    outbox.append(x.grad)
            if trace is not None:
                trace.append((ctx.rank, ctx.pp_rank, kind, mb, c, t0, time.time()))
    return _share_loss(losses, ctx, device)


def _share_loss(losses, ctx, device):
    """Mean loss over microbatches from the last stage to every rank, averaged over dp."""
    value = torch.stack(losses).float().mean() if losses else torch.zeros((), device=device)
    value = value.reshape(1).clone()
    if ctx.pp_size > 1:
        comm.broadcast(value, ctx.pp_ranks[-1], ctx.pp_group)
    if ctx.dp_size > 1:
        comm.all_reduce(value, ctx.dp_group)
        value /= ctx.dp_size
    return value.item()

"""Point-to-point traffic between pipeline stages: fixed shapes, batched isend/irecv, a static plan.

Every message between stages has one precomputed shape ([s, b, h], or [s/tp, b, h] under sequence
parallelism), so receivers allocate without a handshake.

Between two consecutive steps of a rank's schedule (one operation, or a forward and a backward in the
interleaved steady state) there is one exchange: a single `batch_isend_irecv` carrying what the
finished step sends (a forward's output to the next virtual stage, a backward's input gradient to the
previous one) and what the next step must receive (a forward's input, a backward's output gradient).
`exchange_plan` derives these batches from the schedule alone, so tests can replay them without tensors.

All traffic uses the one pp group and tag 0, so messages between two ranks are matched in the order
they were posted, on gloo as on nccl (which ignores tags). A batch is waited for as a whole, sends
included, as nccl's coalesced batches are; `tests/test_pipeline.py` replays every rank's plan under
exactly those rules (a batch completes only when every message in it has its partner posted) and
checks that no schedule the engine accepts can deadlock and that every message meets the one it was
meant for. Batching also keeps nccl safe where one pair of ranks exchanges in both directions in one
group (pp 2 with interleaving): both directions are in flight together instead of serialised.

Once a batch has completed, the activations it sent are released: backward needs only their autograd
graph, not their values (see `release`).

Zero-bubble schedules add W operations, which neither send nor receive, and ZB-V's V places stages pp-1
and pp on the same rank: a message whose peer is this rank is handed over in memory when the step that
makes it finishes, and taken by the step that needs it (always a later one on the same rank).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.flops import UNIT, Costs
from engine.layout import PipelineSchedule
from engine.parallel import comm
from engine.pipeline import zero_bubble


class Message(NamedTuple):
    peer: int      # pp rank at the other end
    kind: str      # "act" (flows to later stages) or "grad" (flows back)
    stage: int     # virtual stage that receives it
    microbatch: int


class Exchange(NamedTuple):
    sends: tuple  # Messages sent by the operations of the previous step
    recvs: tuple  # one per operation of the next step: the Message it needs, or None


def messages(kind: str, chunk: int, mb: int, rank: int, schedule: PipelineSchedule) -> tuple:
    """(what this operation receives, what it sends), each a Message or None."""
    if kind == "W":
        return None, None
    stage = schedule.stage_of(rank, chunk)
    previous, following = schedule.neighbours(stage)
    if kind == "F":
        recv = Message(previous[0], "act", stage, mb) if previous else None
        send = Message(following[0], "act", stage + 1, mb) if following else None
    else:
        recv = Message(following[0], "grad", stage, mb) if following else None
        send = Message(previous[0], "grad", stage - 1, mb) if previous else None
    return recv, send


def exchange_plan(steps: list, schedule: PipelineSchedule, rank: int, costs: Costs = UNIT) -> list:
    """[(Exchange, operations of the step)] for each step, then a last exchange with no operations.

    `steps` groups the schedule's operations (engine.pipeline.schedules.schedule_steps). 1F1B exchanges
    between every two operations: a forward's output leaves with the request for the next backward's
    gradient, and vice versa. The interleaved schedule's steady state pairs a forward with a backward:
    both inputs of a pair arrive in one batch and both outputs leave in the next, as in Megatron-LM's
    interleaved schedule; one batch per operation would deadlock there under batch semantics (the
    replay in tests/test_pipeline.py shows both). Pairing 1F1B as well would be deadlock-free but would
    make each forward wait for the gradient its partner backward needs, serialising neighbouring stages.
    The zero-bubble schedules get `_timed_plan` (`costs`: those their order was built for).
    """
    if schedule.split_backward:
        ops = [op for step in steps for op in step]
        return _timed_plan(ops, schedule, rank, 1 + max(mb for _, _, mb in ops),
                           not any(kind == "B" for kind, _, _ in ops), costs)
    plan, sends = [], ()
    for ops in steps:
        pairs = [messages(kind, chunk, mb, rank, schedule) for kind, chunk, mb in ops]
        plan.append((Exchange(sends, tuple(recv for recv, _ in pairs)), list(ops)))
        sends = tuple(send for _, send in pairs if send is not None)
    plan.append((Exchange(sends, ()), []))
    return plan


def _timed_plan(ops: list, schedule: PipelineSchedule, rank: int, m: int, forward_only: bool, costs) -> list:
    """A zero-bubble schedule's plan: one step per slot of its timeline (engine.pipeline.zero_bubble: the
    distinct start times of its replay; an operation of this rank or none), each message posted by both ends
    at the slot of the operation that needs it, which starts after the one that makes it ended. A batch's
    partners are then in the same-numbered batches of its peers, so every rank's batch k completes once all
    have reached it: no deadlock, whatever the order. (One batch per operation, as in
    1F1B, deadlocks ZB-V, whose ranks exchange in both directions; the replay in the tests shows it.)"""
    slot = zero_bubble.timeline(schedule, m, forward_only, costs)
    at = {slot[(kind, schedule.stage_of(rank, c), mb)]: (kind, c, mb) for kind, c, mb in ops}
    sends: dict = {}
    for kind, c, mb in ops:
        send = messages(kind, c, mb, rank, schedule)[1]
        if send is not None:  # received by the forward or B of the neighbouring stage
            sends.setdefault(slot[("F" if send.kind == "act" else "B", send.stage, mb)], []).append(send)
    plan = []
    for t in range(max([*at, *sends]) + 1):
        op = at.get(t)
        recvs = () if op is None else (messages(*op, rank, schedule)[0],)
        plan.append((Exchange(tuple(sends.get(t, ())), recvs), [] if op is None else [op]))
    plan.append((Exchange((), ()), []))
    return plan


class StageLink:
    """This rank's end of the pipeline: runs the exchanges of a plan with real tensors."""

    def __init__(self, ctx, shape, dtype, device):
        self.ctx, self.shape, self.dtype, self.device = ctx, tuple(shape), dtype, device
        self.kept: dict = {}  # messages to this rank itself (ZB-V's turn of the V), by (kind, stage, microbatch)

    def exchange(self, step: Exchange, tensors: list) -> list:
        """Send `tensors` (one per message in step.sends) and receive step.recvs; wait for the whole batch.

        Sent forward activations are released once the batch is done. Returns one received tensor (or
        None) per entry of step.recvs.
        """
        assert len(tensors) == len(step.sends), "the schedule and its exchange plan disagree"
        ranks, group, me = self.ctx.pp_ranks, self.ctx.pp_group, self.ctx.pp_rank
        ops = []
        for m, t in zip(step.sends, tensors):
            if m.peer == me:
                self.kept[m[1:]] = t.detach()  # a new leaf on the same storage, as a received tensor would be
            else:
                ops.append(comm.send_op(t.detach(), ranks[m.peer], group))
        received = [None if m is None else self.kept.pop(m[1:]) if m.peer == me else
                    torch.empty(self.shape, dtype=self.dtype, device=self.device) for m in step.recvs]
        ops += [comm.recv_op(buf, ranks[m.peer], group) for m, buf in zip(step.recvs, received)
                if m is not None and m.peer != me]
        if ops:
            for work in comm.batch_isend_irecv(ops):
                work.wait()
        for m, t in zip(step.sends, tensors):
            if m.kind == "act":
                release(t)
        return received


def release(t: torch.Tensor) -> None:
    """Drop a tensor's values but keep its autograd graph (backward of the residual add needs none)."""
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from an output whose storage may have been released (shapes are not re-checked)."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)

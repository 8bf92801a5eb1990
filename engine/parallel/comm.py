"""Every torch.distributed collective the engine uses, in one place.

Keeping them here pins the API surface to what exists from torch 2.11 to 2.15: torch 2.13 deprecates
`all_gather_into_tensor` / `reduce_scatter_tensor`, but their replacements are missing in 2.11, so the
old names stay and only that deprecation warning is silenced, here and nowhere else. The object
collectives and `any_rank` also work in a single process without torch.distributed (tools, tests).

Byte counting: inside `with counting() as counter:` every collective and point-to-point transfer this
process starts is appended to `counter.records` as a `CommRecord`: the operation, the group it ran on
(None: the default group), the group's size, its payload in bytes and the bytes this rank sends under
the standard ring algorithms. With n ranks in the group:
    all-reduce of N bytes                     2(n-1)/n * N
    all-gather producing N bytes in all        (n-1)/n * N   ((n-1) times this rank's input)
    reduce-scatter of an N-byte input          (n-1)/n * N   ((n-1) times this rank's output)
    broadcast of N bytes                       N on the source rank, 0 elsewhere
    all-to-all                                 the rows this rank sends to the others
    point-to-point send / receive of N bytes   N / 0
A group of one rank sends nothing (recorded with 0). Calls are recorded when they are started, async or
not; object collectives and barriers (control traffic, outside the training step) are not counted.
Outside `counting()` the only cost is one module-level None check per call.

Every call also notes itself as the last collective this rank issued (`last_collective()`: the operation and the
global ranks of its group, or a point-to-point exchange's peers): when one fails, the launcher names it and its
group (engine/run/guard.py), which may not be the group of the phase the trainer was in.

gloo on CUDA tensors (`--distributed-backend gloo` on GPUs, several ranks sharing one): torch's ProcessGroupGloo
(torch/csrc/distributed/c10d/ProcessGroupGloo.cpp and ProcessGroupGlooCuda.cpp as read on pytorch's main branch;
the GPU machines here run torch 2.11) runs its collectives in host memory. Most have a CUDA variant that copies
the tensors to pinned host buffers on a side stream, runs there and copies back, the returned work's wait()
ordering the copy back before later work on the caller's stream. Point-to-point has none: send and recv hand
the tensor's data pointer to the TCP transport, which reads and writes host memory only, and nothing checks the
device. So, per operation of this module:
    all_reduce                 carried (AsyncAllreduceCUDAWork)
    broadcast                  carried (AsyncBroadcastCUDAWork)
    all_gather_into            carried (all_gather_into_tensor -> _allgather_base -> allgather's CUDA work)
    reduce_scatter_into        carried (reduce_scatter_tensor: a clone all-reduced as above, this rank's
                               slice kept: n times a reduce-scatter's traffic)
    all_to_all_single          carried (AsyncAlltoallCUDAWork, uneven splits too)
    send_op / recv_op          NOT carried: staged here through host memory (`host_send_op`, `host_recv_op`)
    barrier                    no tensor
    all_gather_object          objects travel as CPU tensors under gloo (torch's object-collective device)
`stages(backend, device_type, op)` is that table as a function; nccl and CPU tensors never stage. A staged
send copies the tensor to the host when the op is made; a staged receive lands in a host buffer, and the
work `batch_isend_irecv` returns for it copies the buffer into the tensor in wait(). Copies move bytes, so
a staged transfer delivers bitwise what an unstaged one would.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


@dataclass(frozen=True)
class CommRecord:
    """One collective or transfer seen by `counting()`."""
    op: str          # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv
    group: object    # the process group it ran on; None: the default group
    group_size: int
    payload: int     # bytes: the reduced tensor, the gathered output, the scattered input, the message
    sent: float      # bytes this rank sends (ring algorithms, see the module docstring)


@dataclass
class CommCounter:
    """The records of one `counting()` block, in the order the calls were started."""
    records: list = field(default_factory=list)

    def sent(self, group=..., op: Optional[str] = None) -> float:
        """Bytes this rank sent, over all records or those on `group` (None: the default group) / of `op`."""
        return sum(r.sent for r in self.records
                   if (group is ... or r.group is group) and (op is None or r.op == op))


_counter: Optional[CommCounter] = None

# Bytes sent, as a multiple of the payload, by an op over n ranks (broadcast and p2p are special-cased).
_RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n}


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """Record every collective and transfer started in the block (nested blocks: the inner one records)."""
    global _counter
    outer, _counter = _counter, CommCounter()
    try:
        yield _counter
    finally:
        _counter = outer


def _record(op: str, t: torch.Tensor, group, src: Optional[int] = None) -> None:
    n = world_size(group)
    payload = t.numel() * t.element_size()
    if n == 1 or op == "recv":
        sent = 0.0
    elif op == "send":
        sent = float(payload)
    elif op == "broadcast":
        sent = float(payload) if rank() == src else 0.0
    else:
        sent = _RING_FACTOR[op](n) * payload
    _counter.records.append(CommRecord(op, group, n, payload, sent))


# The two deprecation warnings are filtered once, at import: a `catch_warnings` block around each call cost
# about 60 us of CPU per collective (6% of a ZeRO-2 step on CPU ranks). The filters match only these messages.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated.*")
warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.*deprecated.*")


# The collective this rank issued last, (operation, group, peers): what the launcher names when one fails
# (engine/run/guard.py), since the error a survivor gets does not say which group it was in.
_last: list = [None, None, None]


def last_collective() -> Optional[tuple]:
    """(operation, the global ranks of its group or the peers of a point-to-point exchange) of the last collective
    this rank issued, or None."""
    op, group, peers = _last
    if op is None:
        return None
    if peers is not None:
        return op, sorted(peers)
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size()))
    except (RuntimeError, ValueError):  # the group is already destroyed
        ranks = None
    return op, ranks


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce(t: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    _last[:] = ("all_reduce", group, None)
    if _counter is not None:
        _record("all_reduce", t, group)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `inp` along dim 0 into `out`."""
    _last[:] = ("all_gather", group, None)
    if _counter is not None:
        _record("all_gather", out, group)
    return dist.all_gather_into_tensor(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    """Sum `inp` over ranks and keep this rank's dim-0 slice in `out`."""
    _last[:] = ("reduce_scatter", group, None)
    if _counter is not None:
        _record("reduce_scatter", inp, group)
    return dist.reduce_scatter_tensor(out, inp.contiguous(), op=op, group=group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, group=None):
    """Rank i sends rows [sum(in_splits[:j]), +in_splits[j]) of `inp` to rank j of `group` and receives
    out_splits[j] rows from rank j, in rank order, into `out` (uneven splits; gloo supports them on CPU)."""
    _last[:] = ("all_to_all", group, None)
    if _counter is not None:
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        me = rank(group)
        sent = float(sum(n for j, n in enumerate(in_splits) if j != me) * row)
        _counter.records.append(CommRecord("all_to_all", group, world_size(group), inp.numel() * inp.element_size(),
                                           sent))
    return dist.all_to_all_single(out, inp.contiguous(), list(out_splits), list(in_splits), group=group)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    """`src` is a global rank."""
    _last[:] = ("broadcast", group, None)
    if _counter is not None:
        _record("broadcast", t, group, src)
    return dist.broadcast(t, src=src, group=group, async_op=async_op)


def all_gather_object(obj, group=None) -> list:
    """Every rank's `obj`, in rank order ([obj] without torch.distributed)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size(group)
    _last[:] = ("all_gather_object", group, None)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, device="cpu") -> bool:
    """True on every rank when `flag` is true on at least one (one all-reduce over the default group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(t, op=ReduceOp.MAX)
    return bool(t.item())


def side_store(prefix: str, timeout_s: float = 10.0):
    """A client of its own to the job's rendezvous store (MASTER_ADDR:MASTER_PORT), keys under `prefix`, for a
    background thread: the process group's client must not be shared with one. None without a store."""
    import datetime
    import os
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError):
        return None
    return dist.PrefixStore(prefix, client)


def barrier(group=None) -> None:
    if dist.is_initialized():
        _last[:] = ("barrier", group, None)
        dist.barrier(group=group)


# Whether gloo carries CUDA tensors, per operation of this module (the table in the module docstring).
GLOO_CARRIES_CUDA = {"all_reduce": True, "broadcast": True, "all_gather": True, "reduce_scatter": True,
                     "all_to_all": True, "send": False, "recv": False}


def stages(backend: Optional[str], device_type: str, op: str) -> bool:
    """Whether `op` on a tensor of `device_type` goes through host memory under `backend`: only what gloo
    cannot carry on CUDA tensors does."""
    return backend == "gloo" and device_type == "cuda" and not GLOO_CARRIES_CUDA[op]


def _stages(op: str, t: torch.Tensor, group) -> bool:
    return t.device.type != "cpu" and stages(dist.get_backend(group), t.device.type, op)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


class _HostRecv(dist.P2POp):
    """A receive into a host buffer (`tensor`) meant for `target`, a tensor the backend cannot write."""
    target: torch.Tensor


class _CopyBack:
    """The work of a `_HostRecv`: wait() waits for the host buffer, then copies it into the target."""

    def __init__(self, work, p2p: _HostRecv):
        self.work, self.p2p = work, p2p

    def wait(self) -> bool:
        self.work.wait()
        self.p2p.target.copy_(self.p2p.tensor)
        return True


def host_send_op(t: torch.Tensor, peer: int, group=None):
    """`send_op` staged through host memory: what leaves is a host copy of `t`, made now."""
    return dist.P2POp(dist.isend, _host_copy(t.detach()), peer, group)


def host_recv_op(t: torch.Tensor, peer: int, group=None):
    """`recv_op` staged through host memory: the message lands in a host buffer, copied into `t` when the
    work `batch_isend_irecv` returns for it is waited for."""
    p2p = _HostRecv(dist.irecv, torch.empty(t.shape, dtype=t.dtype), peer, group)
    p2p.target = t
    return p2p


def send_op(t: torch.Tensor, peer: int, group=None):
    """A send of `t` to global rank `peer`, for `batch_isend_irecv` (staged where the backend needs it)."""
    if _stages("send", t, group):
        return host_send_op(t, peer, group)
    return dist.P2POp(dist.isend, t.contiguous(), peer, group)


def recv_op(t: torch.Tensor, peer: int, group=None):
    """A receive from global rank `peer` into `t`, for `batch_isend_irecv` (staged where the backend needs it)."""
    if _stages("recv", t, group):
        return host_recv_op(t, peer, group)
    return dist.P2POp(dist.irecv, t, peer, group)


def batch_isend_irecv(ops: list) -> list:
    """Post sends and receives (all on one group) as one batch; returns the work handles to wait on.

    nccl runs the batch as one group call (one handle for all); gloo posts each op on its own, so a staged
    receive (gloo only) has its own work, which copies its buffer back when waited for."""
    _last[:] = ("send/recv", None, {rank()} | {p2p.peer for p2p in ops})
    if _counter is not None:
        world = dist.group.WORLD  # a P2POp made with group None holds the default group itself
        for p2p in ops:
            _record("send" if p2p.op is dist.isend else "recv", p2p.tensor, None if p2p.group is world else p2p.group)
    works = dist.batch_isend_irecv(ops)
    if not any(isinstance(p2p, _HostRecv) for p2p in ops):
        return works
    return [_CopyBack(w, p2p) if isinstance(p2p, _HostRecv) else w for w, p2p in zip(works, ops, strict=True)]


def new_group(ranks: list, backend: Optional[str] = None, timeout=None):
    kw = {}
    if timeout is not None:
        kw["timeout"] = timeout
    return dist.new_group(ranks=ranks, backend=backend, **kw)


def destroy_group(group) -> None:
    if dist.is_initialized() and group is not None:
        dist.destroy_process_group(group)

"""Every torch.distributed collective the engine uses, in one place.

Keeping them here pins the API surface to what exists from torch 2.11 to 2.15: torch 2.13 deprecates
`all_gather_into_tensor` / `reduce_scatter_tensor`, but their replacements are missing in 2.11, so the
old names stay and only that deprecation warning is silenced, here and nowhere else. The object
collectives and `any_rank` also work in a single process without torch.distributed (tools, tests).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated.*")
        warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.*deprecated.*")
        yield


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce(t: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `inp` along dim 0 into `out`."""
    with _quiet():
        return dist.all_gather_into_tensor(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False):
    """Sum `inp` over ranks and keep this rank's dim-0 slice in `out`."""
    with _quiet():
        return dist.reduce_scatter_tensor(out, inp.contiguous(), op=op, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    """`src` is a global rank."""
    return dist.broadcast(t, src=src, group=group, async_op=async_op)


def all_gather_object(obj, group=None) -> list:
    """Every rank's `obj`, in rank order ([obj] without torch.distributed)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, device="cpu") -> bool:
    """True on every rank when `flag` is true on at least one (one all-reduce over the default group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(t, op=ReduceOp.MAX)
    return bool(t.item())


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def send_op(t: torch.Tensor, peer: int, group=None):
    """A send of `t` to global rank `peer`, for `batch_isend_irecv`."""
    return dist.P2POp(dist.isend, t.contiguous(), peer, group)


def recv_op(t: torch.Tensor, peer: int, group=None):
    """A receive from global rank `peer` into `t`, for `batch_isend_irecv`."""
    return dist.P2POp(dist.irecv, t, peer, group)


def batch_isend_irecv(ops: list) -> list:
    """Post sends and receives (all on one group) as one batch; returns the work handles to wait on.

    nccl runs the batch as one group call (one handle for all); gloo posts each op on its own."""
    return dist.batch_isend_irecv(ops)


def new_group(ranks: list, backend: Optional[str] = None, timeout=None):
    kw = {}
    if timeout is not None:
        kw["timeout"] = timeout
    return dist.new_group(ranks=ranks, backend=backend, **kw)


def destroy_group(group) -> None:
    if dist.is_initialized() and group is not None:
        dist.destroy_process_group(group)

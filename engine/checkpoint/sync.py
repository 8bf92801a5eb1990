"""The few collectives checkpointing needs, on the default group; also usable by a single process
without torch.distributed (tools, tests, benchmarks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine import comm


def gather_objects(obj) -> list:
    return comm.all_gather_object(obj) if dist.is_initialized() else [obj]


def any_rank(flag: bool, device="cpu") -> bool:
    """True on every rank when `flag` is true on at least one."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    return bool(t.item())

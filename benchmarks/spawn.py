"""Run a measurement on several gloo ranks spawned for a benchmark and collect every rank's rows."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel import comm


def _worker(rank: int, rows_of, world: int, init_file: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gathered = comm.all_gather_object(rows_of(rank))
    if rank == 0:
        torch.save([r for per_rank in gathered for r in per_rank], out)
    dist.barrier()
    dist.destroy_process_group()


def spawn_rows(rows_of, world: int) -> list:
    """`rows_of(rank)` (a module-level function returning a list of rows) on `world` spawned ranks; all rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(rows_of, world, os.path.join(tmp, "init"), out), nprocs=world, join=True)
        return torch.load(out, weights_only=False)

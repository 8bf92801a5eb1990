"""Ranks laid out as (tp, dp, pp) coordinates and the process groups built from that one order.

Megatron's order: tp varies fastest, then dp, then pp, so a TP group is a run of adjacent ranks on one
node (NVLink) and pipeline neighbours are a whole tp*dp block apart. Every group is derived from
`rank_grid`, a pure function the tests check without any process group.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Optional

from engine.config import check_tp_fits_node, check_world_size
from engine.parallel import comm
from engine.parallel.random import RNGTracker


def rank_grid(world_size: int, tp: int, pp: int) -> dict:
    """Global-rank lists of every group kind: tp, dp, pp, mp (tp x pp) and embedding (first+last stage)."""
    check_world_size(world_size, tp, pp)
    dp = world_size // (tp * pp)
    rank = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731 - the layout in one line
    grid = {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [[rank(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    grid["embedding"] = [sorted({g[0], g[-1]}) for g in grid["pp"]]
    return grid


def coords(rank: int, tp: int, dp: int) -> tuple:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


@dataclass
class ParallelContext:
    """Sizes, coordinates and groups of this rank; passed to everything that communicates."""
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    vpp_size: int = 1
    sequence_parallel: bool = False
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    pp_ranks: list = field(default_factory=lambda: [0])
    tp_ranks: list = field(default_factory=lambda: [0])
    dp_ranks: list = field(default_factory=lambda: [0])
    rng: object = None  # engine.parallel.random.RNGTracker, set by build_context / the trainer

    @property
    def tp_rank(self) -> int:
        return coords(self.rank, self.tp_size, self.dp_size)[0]

    @property
    def dp_rank(self) -> int:
        return coords(self.rank, self.tp_size, self.dp_size)[1]

    @property
    def pp_rank(self) -> int:
        return coords(self.rank, self.tp_size, self.dp_size)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # Sequence parallelism is decided here, once: the model and the layers ask, they never test the flag.
    @property
    def seq_split(self) -> int:
        """Ways the activations between tensor-parallel regions are split along the sequence."""
        return self.tp_size if self.sequence_parallel else 1

    def local_seq(self, t):
        """This rank's part of a tensor laid out by sequence position along dim 0."""
        return t.chunk(self.seq_split, dim=0)[self.tp_rank] if self.seq_split > 1 else t

    def full_seq_len(self, local_len: int) -> int:
        return local_len * self.seq_split

    def activation_shape(self, seq_length: int, micro_batch: int, hidden: int) -> tuple:
        """The shape of the activations a layer takes and gives (and pipeline stages exchange): [s, b, h]."""
        return seq_length // self.seq_split, micro_batch, hidden

    def dropout_rng(self, split_over_tp: bool):
        """The random stream for dropout on a tensor: per TP rank when the tensor is split over TP, the one
        shared by the TP group otherwise (engine.parallel.random)."""
        return self.rng.fork() if split_over_tp and self.rng is not None else contextlib.nullcontext()

    def residual_dropout_rng(self):
        """Dropout on the residual stream, which is split over TP exactly when the sequence is."""
        return self.dropout_rng(self.seq_split > 1)

    @classmethod
    def virtual(cls, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int = 1, tp_rank: int = 0, pp_rank: int = 0,
                dp_rank: int = 0, sequence_parallel: bool = False) -> "ParallelContext":
        """A context with coordinates but no process groups: for building shapes (meta device, planners)."""
        rank = tp_rank + tp * (dp_rank + dp * pp_rank)
        grid = rank_grid(tp * pp * dp, tp, pp)
        ctx = cls(world_size=tp * pp * dp, rank=rank, tp_size=tp, pp_size=pp, dp_size=dp, vpp_size=vpp,
                  sequence_parallel=sequence_parallel and tp > 1)
        ctx._fill_ranks(grid)
        return ctx

    def _fill_ranks(self, grid: dict) -> None:
        mine = lambda kind: next(g for g in grid[kind] if self.rank in g)  # noqa: E731
        self.tp_ranks, self.dp_ranks, self.pp_ranks = mine("tp"), mine("dp"), mine("pp")

    def destroy(self) -> None:
        """Release the subgroups this context made (the default group stays)."""
        for name in ("tp_group", "dp_group", "pp_group", "mp_group", "embedding_group"):
            comm.destroy_group(getattr(self, name))
            setattr(self, name, None)


def build_context(world_size: int, rank: int, tp: int, pp: int, *, vpp: int = 1, sequence_parallel: bool = False,
                  gpus_per_node: Optional[int] = None, timeout_minutes: Optional[float] = None,
                  seed: int = 1234, device_type: str = "cpu") -> ParallelContext:
    """Make every group (each rank takes part in all new_group calls, in one order) and the RNG tracker."""
    check_tp_fits_node(tp, gpus_per_node)  # callers other than the launcher skip validate
    grid = rank_grid(world_size, tp, pp)
    ctx = ParallelContext(world_size=world_size, rank=rank, tp_size=tp, pp_size=pp, dp_size=world_size // (tp * pp),
                          vpp_size=vpp, sequence_parallel=sequence_parallel and tp > 1)
    ctx._fill_ranks(grid)
    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None
    for kind, attr in (("tp", "tp_group"), ("dp", "dp_group"), ("pp", "pp_group"), ("mp", "mp_group"),
                       ("embedding", "embedding_group")):
        for ranks in grid[kind]:
            group = comm.new_group(ranks, timeout=timeout)
            if rank in ranks:
                setattr(ctx, attr, group)
    if pp == 1:
        ctx.embedding_group = None  # nothing to tie across stages
    ctx.rng = RNGTracker.for_context(ctx, seed, device_type)
    return ctx


def layout_table(world_size: int, tp: int, pp: int, gpus_per_node: Optional[int] = None) -> str:
    """A compact table of every rank's node and coordinates, printed by rank 0 at start."""
    dp = world_size // (tp * pp)
    per_node = gpus_per_node or world_size
    rows = [f"{'rank':>5} {'node':>5} {'tp':>3} {'pp':>3} {'dp':>3}"]
    for r in range(world_size):
        t, d, p = coords(r, tp, dp)
        rows.append(f"{r:>5} {r // per_node:>5} {t:>3} {p:>3} {d:>3}")
    return "\n".join(rows)

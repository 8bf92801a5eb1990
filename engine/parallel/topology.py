"""Ranks laid out as (tp, cp, dp, pp) coordinates and the process groups built from that one order.

Megatron's order: tp varies fastest, then cp, then dp, then pp, so a TP group is a run of adjacent ranks
on one node (NVLink), a context-parallel ring stays on the node while tp x cp fits in it, and pipeline
neighbours are a whole tp*cp*dp block apart. CP ranks hold replicas of the weights, like dp ranks: the
gradients are reduced, and the distributed optimizer shards, over the dp x cp group ("dp_cp").
Expert parallelism is carved from dp (Megatron's layout): each run of ep consecutive dp ranks ("ep")
splits every MoE layer's experts and exchanges tokens all-to-all; an expert's replicas are the dp ranks
ep apart, times cp ("edp_cp"), which is where expert gradients are reduced and expert optimizer state
sharded. The ranks holding different tokens of one microbatch (tp under sequence parallelism, times cp:
"tp_cp", the token group) decide together what depends on the whole microbatch (MoE routing). Every group is derived from `rank_grid`, a pure function the tests check without any process group.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Optional

from engine.layout import Layout
from engine.parallel import comm
from engine.parallel.random import RNGTracker
from engine.validation import check_tp_fits_node, check_world_size


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """Global-rank lists of every group kind: tp, cp, tp_cp, dp, dp_cp, ep, edp_cp, pp, mp (tp x pp) and embedding
    (first+last stage)."""
    check_world_size(world_size, tp, pp, cp)
    dp = world_size // (tp * cp * pp)
    assert dp % ep == 0, f"ep {ep} must divide dp {dp}"  # validated with one line in engine.validation
    rank = lambda t, c, d, p: t + tp * (c + cp * (d + dp * p))  # noqa: E731 - the layout in one line
    T, C, D, P, E, K = range(tp), range(cp), range(dp), range(pp), range(ep), range(dp // ep)
    grid = {
        "tp": [[rank(t, c, d, p) for t in T] for p in P for d in D for c in C],
        "cp": [[rank(t, c, d, p) for c in C] for p in P for d in D for t in T],
        "tp_cp": [[rank(t, c, d, p) for c in C for t in T] for p in P for d in D],
        "dp": [[rank(t, c, d, p) for d in D] for p in P for c in C for t in T],
        "dp_cp": [[rank(t, c, d, p) for d in D for c in C] for p in P for t in T],
        "pp": [[rank(t, c, d, p) for p in P] for d in D for c in C for t in T],
        "mp": [[rank(t, c, d, p) for p in P for t in T] for d in D for c in C],
        "ep": [[rank(t, c, k * ep + e, p) for e in E] for p in P for k in K for c in C for t in T],
        "edp_cp": [[rank(t, c, k * ep + e, p) for k in K for c in C] for p in P for e in E for t in T],
    }
    grid["embedding"] = [sorted({g[0], g[-1]}) for g in grid["pp"]]
    grid["step"] = [list(range(world_size))]  # the zero-bubble optimizer's post-validation (engine.optim)
    return grid


def grid_coords(rank: int, tp: int, cp: int, dp: int) -> tuple:
    """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def coords(rank: int, tp: int, dp: int, cp: int = 1) -> tuple:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    t, _, d, p = grid_coords(rank, tp, cp, dp)
    return t, d, p


@dataclass
class ParallelContext:
    """This rank's place in the layout and its groups; passed to everything that communicates."""
    rank: int = 0
    layout: Layout = field(default_factory=Layout)  # the degrees, schedule and sharding (engine.layout)
    cp_comm_type: str = "p2p"  # how attention reaches the other CP ranks' K/V (engine.parallel.ring_attention)
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    cp_group: object = None
    tp_cp_group: object = None  # the tp group when cp is 1, the cp group when tp is 1
    dp_cp_group: object = None  # gradients and optimizer shards: the dp group itself when cp is 1
    ep_group: object = None
    edp_cp_group: object = None  # expert gradients and optimizer shards: dp_cp_group when ep is 1
    step_group: object = None  # every rank, apart from the default group: post-validation's all-reduce
    pp_ranks: list = field(default_factory=lambda: [0])
    tp_ranks: list = field(default_factory=lambda: [0])
    dp_ranks: list = field(default_factory=lambda: [0])
    cp_ranks: list = field(default_factory=lambda: [0])
    dp_cp_ranks: list = field(default_factory=lambda: [0])
    ep_ranks: list = field(default_factory=lambda: [0])
    rng: object = None  # engine.parallel.random.RNGTracker, set by build_context / the trainer

    # The sizes are the layout's.
    @property
    def world_size(self) -> int:
        return self.layout.num_gpus

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def vpp_size(self) -> int:
        return self.layout.vpp

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def _coords(self) -> tuple:
        return grid_coords(self.rank, self.tp_size, self.cp_size, self.dp_size)

    @property
    def tp_rank(self) -> int:
        return self._coords()[0]

    @property
    def cp_rank(self) -> int:
        return self._coords()[1]

    @property
    def dp_rank(self) -> int:
        return self._coords()[2]

    @property
    def pp_rank(self) -> int:
        return self._coords()[3]

    @property
    def dp_cp_size(self) -> int:
        """Replicas of this rank's weights: gradients are reduced, and optimizer state sharded, over them."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep_size

    @property
    def edp_cp_size(self) -> int:
        """Replicas of this rank's experts: expert gradients are reduced, and their optimizer state sharded, over them."""
        return self.dp_cp_size // self.ep_size

    @property
    def edp_cp_rank(self) -> int:
        return self.cp_rank + self.cp_size * (self.dp_rank // self.ep_size)

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
        """This rank's part (under sequence parallelism) of a tensor laid out by this CP rank's positions
        along dim 0."""
        return t.chunk(self.seq_split, dim=0)[self.tp_rank] if self.seq_split > 1 else t

    # The ranks holding a microbatch's tokens, each a different part of them: tp under sequence parallelism,
    # times cp (Megatron's tp_cp group); what they decide about the whole microbatch, they decide together.
    @property
    def token_group(self):
        return self.tp_cp_group if self.seq_split > 1 else self.cp_group

    @property
    def token_group_size(self) -> int:
        return self.seq_split * self.cp_size

    @property
    def token_group_rank(self) -> int:
        """This rank's place in its token group: cp-major, as the group's ranks are ordered."""
        return self.cp_rank * self.seq_split + (self.tp_rank if self.seq_split > 1 else 0)

    def activation_shape(self, seq_length: int, micro_batch: int, hidden: int) -> tuple:
        """The shape of the activations a layer takes and gives (and pipeline stages exchange): [s, b, h]."""
        return seq_length // (self.seq_split * self.cp_size), micro_batch, hidden

    def dropout_rng(self, split_over_tp: bool):
        """The random stream for dropout on a tensor: per TP rank when the tensor is split over TP, the one
        shared by the TP group otherwise (engine.parallel.random)."""
        return self.rng.fork() if split_over_tp and self.rng is not None else contextlib.nullcontext()

    def residual_dropout_rng(self):
        """Dropout on the residual stream, which is split over TP exactly when the sequence is."""
        return self.dropout_rng(self.seq_split > 1)

    @classmethod
    def virtual(cls, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int = 1, tp_rank: int = 0, pp_rank: int = 0,
                dp_rank: int = 0, sequence_parallel: bool = False, cp: int = 1,
                cp_rank: int = 0, ep: int = 1, schedule: Optional[str] = None, sharding: Optional[str] = None,
                layout: Optional[Layout] = None) -> "ParallelContext":
        """A context with coordinates but no process groups: for building shapes (meta device, planners) and
        one-rank runs. `layout` replaces the sizes, schedule and sharding given one by one."""
        layout = layout or Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=sequence_parallel, cp=cp, ep=ep,
                                  pipeline_schedule=schedule, sharding_strategy=sharding)
        rank = tp_rank + layout.tp * (cp_rank + layout.cp * (dp_rank + layout.dp * pp_rank))
        ctx = cls(rank=rank, layout=layout)
        ctx._fill_ranks(rank_grid(layout.num_gpus, layout.tp, layout.pp, layout.cp, layout.ep))
        return ctx

    def _fill_ranks(self, grid: dict) -> None:
        mine = lambda kind: next(g for g in grid[kind] if self.rank in g)  # noqa: E731
        self.tp_ranks, self.dp_ranks, self.pp_ranks = mine("tp"), mine("dp"), mine("pp")
        self.cp_ranks, self.dp_cp_ranks, self.ep_ranks = mine("cp"), mine("dp_cp"), mine("ep")

    def destroy(self) -> None:
        """Release the subgroups this context made (the default group stays)."""
        if self.tp_cp_group in (self.tp_group, self.cp_group):
            self.tp_cp_group = None
        if self.edp_cp_group is self.dp_cp_group:
            self.edp_cp_group = None
        if self.dp_cp_group is self.dp_group:
            self.dp_cp_group = None
        for name in GROUPS.values():
            comm.destroy_group(getattr(self, name))
            setattr(self, name, None)


# The group kinds of `rank_grid` a context keeps, and the attribute each is kept in. cp and dp_cp are
# made only when cp > 1 (with cp 1 there is no CP group, and dp x cp is the dp group); ep and edp_cp only
# when ep > 1 (with ep 1 the experts' replicas are the dp x cp group); embedding and step only when pp > 1
# (nothing to tie across stages; no stage to run ahead of another).
GROUPS = {"tp": "tp_group", "dp": "dp_group", "pp": "pp_group", "mp": "mp_group", "embedding": "embedding_group",
          "cp": "cp_group", "tp_cp": "tp_cp_group", "dp_cp": "dp_cp_group", "ep": "ep_group", "edp_cp": "edp_cp_group",
          "step": "step_group"}
_ONLY_WHEN = {"cp": "cp", "tp_cp": "tp_cp", "dp_cp": "cp", "ep": "ep", "edp_cp": "ep", "embedding": "pp", "step": "pp"}


def build_context(world_size: int, rank: int, tp: int, pp: int, *, vpp: int = 1, sequence_parallel: bool = False,
                  gpus_per_node: Optional[int] = None, timeout_minutes: Optional[float] = None,
                  seed: int = 1234, device_type: str = "cpu", cp: int = 1, cp_comm_type: str = "p2p", ep: int = 1,
                  schedule: Optional[str] = None, sharding: Optional[str] = None) -> ParallelContext:
    """`context_for` the layout of these sizes, pipeline schedule and sharding strategy."""
    check_world_size(world_size, tp, pp, cp)
    layout = Layout(tp=tp, pp=pp, dp=world_size // (tp * cp * pp), vpp=vpp, sequence_parallel=sequence_parallel, cp=cp,
                    ep=ep, pipeline_schedule=schedule, sharding_strategy=sharding)
    return context_for(layout, rank, gpus_per_node=gpus_per_node, timeout_minutes=timeout_minutes, seed=seed,
                       device_type=device_type, cp_comm_type=cp_comm_type)


def context_for(layout: Layout, rank: int, *, gpus_per_node: Optional[int] = None,
                timeout_minutes: Optional[float] = None, seed: int = 1234, device_type: str = "cpu",
                cp_comm_type: str = "p2p") -> ParallelContext:
    """Make every group of `layout` (each rank takes part in all new_group calls, in one order) and the RNG
    tracker."""
    check_tp_fits_node(layout.tp, gpus_per_node)  # callers other than the launcher skip validate
    grid = rank_grid(layout.num_gpus, layout.tp, layout.pp, layout.cp, layout.ep)
    ctx = ParallelContext(rank=rank, layout=layout, cp_comm_type=cp_comm_type)
    ctx._fill_ranks(grid)
    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None
    sizes = {"cp": layout.cp, "ep": layout.ep, "pp": layout.pp, "tp_cp": min(layout.tp, layout.cp)}
    for kind, attr in GROUPS.items():
        if kind in _ONLY_WHEN and sizes[_ONLY_WHEN[kind]] == 1:
            continue  # (made and dropped, a group would keep its threads and sockets for the whole process)
        for ranks in grid[kind]:
            group = comm.new_group(ranks, timeout=timeout)
            if rank in ranks:
                setattr(ctx, attr, group)
    if layout.cp == 1:
        ctx.dp_cp_group = ctx.dp_group
    if min(layout.tp, layout.cp) == 1:
        ctx.tp_cp_group = ctx.tp_group if layout.cp == 1 else ctx.cp_group
    if layout.ep == 1:
        ctx.edp_cp_group = ctx.dp_cp_group
    ctx.rng = RNGTracker.for_context(ctx, seed, device_type)
    return ctx


def layout_table(world_size: int, tp: int, pp: int, gpus_per_node: Optional[int] = None, cp: int = 1) -> str:
    """A compact table of every rank's node and coordinates, printed by rank 0 at start."""
    dp = world_size // (tp * cp * pp)
    per_node = gpus_per_node or world_size
    cp_col = lambda c: f" {c:>3}" if cp > 1 else ""  # noqa: E731 - a cp column only when there is CP
    rows = [f"{'rank':>5} {'node':>5} {'tp':>3}{cp_col('cp')} {'pp':>3} {'dp':>3}"]
    for r in range(world_size):
        t, c, d, p = grid_coords(r, tp, cp, dp)
        rows.append(f"{r:>5} {r // per_node:>5} {t:>3}{cp_col(c)} {p:>3} {d:>3}")
    return "\n".join(rows)

"""The run's parallel layout, decided once: the degrees, the pipeline schedule and the data-parallel sharding.

`Layout` is resolved from the flags once (`Layout.from_config`) and carried by the parallel context
(`ParallelContext.layout`); the model split, the pipeline's orders and exchanges, the runner, the step,
validation, the start-up report and the planner all read this one value, so whether a run is V-shaped,
splits its backward or shards its weights is decided here and nowhere else. The planner builds the same value
for every candidate it rates (torchtitan's ParallelDims serves its trainer and its estimator alike).

`PipelineSchedule` is the schedule as a value: its name (Megatron-LM's rule picks one when the flag is
absent), chunks per rank, where each virtual stage lives (round-robin, or ZB-V's V: chunk 0 down the ranks,
chunk 1 back up, Qi et al. 2024 sec. 4), whether backward splits into input- and weight-gradient passes, and
which rank computes the loss. `Sharding` says what the dp x cp replicas shard (Megatron-FSDP's strategy
names): optimizer state, gradients, weights. The layer split (`Layout.layer_ids`) follows from both.

A Layout also carries the micro batch size and the recomputation: how a global batch is cut and what backward
recomputes, which the planner searches beside the degrees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.config import PIPELINE_SCHEDULES, SHARDING_STRATEGIES


@dataclass(frozen=True)
class ScheduleKind:
    """What a --pipeline-schedule name means; every rule about schedules reads these, never the names."""
    chunks: Optional[int]   # model chunks per rank it runs: fixed, or None for --vpp's (at least 2)
    split_backward: bool    # backward as an input-gradient pass (B) and a deferred weight-gradient pass (W)
    v_shape: bool           # chunk 0 down the ranks, chunk 1 back up (rank r: stages r and 2pp - 1 - r)
    shape: str              # how its chunks sit, for messages
    instead: str            # what to use when its chunk count does not fit, for messages


SCHEDULE_KINDS = {
    "1f1b": ScheduleKind(1, False, False, "one chunk per rank", "interleaved"),
    "interleaved": ScheduleKind(None, False, False, "round-robin", "1f1b"),
    "zb-h1": ScheduleKind(1, True, False, "one chunk per rank", "zb-v (two chunks per rank in a V)"),
    "zb-v": ScheduleKind(2, True, True, "a V", "zb-h1"),
}
assert tuple(SCHEDULE_KINDS) == PIPELINE_SCHEDULES


@dataclass(frozen=True)
class PipelineSchedule:
    name: str = "1f1b"
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank

    @classmethod
    def of(cls, name: Optional[str], pp: int = 1, vpp: Optional[int] = None) -> "PipelineSchedule":
        """--pipeline-schedule, else interleaved with --vpp > 1 (Megatron-LM's rule), else 1f1b; zb-v runs the
        two chunks of its V whatever --vpp says (validation refuses another)."""
        if name not in (None,) + PIPELINE_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {name!r}")
        name = name or ("interleaved" if (vpp or 1) > 1 else "1f1b")
        fixed = SCHEDULE_KINDS[name].chunks
        return cls(name, pp, vpp or 1 if fixed in (None, 1) else fixed)

    @property
    def kind(self) -> ScheduleKind:
        return SCHEDULE_KINDS[self.name]

    @property
    def v_shape(self) -> bool:
        return self.kind.v_shape

    @property
    def split_backward(self) -> bool:
        """Each backward is an input-gradient pass (B) and a deferred weight-gradient pass (W) (with pp > 1:
        one stage has nothing to overlap)."""
        return self.kind.split_backward and self.pp > 1

    @property
    def interleaved(self) -> bool:
        """Several chunks per rank round-robin (Megatron's interleaved 1F1B), which runs microbatches in groups
        of pp."""
        return self.vpp > 1 and not self.kind.v_shape and not self.kind.split_backward

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage model chunk `chunk` on pipeline rank `rank` holds."""
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def place(self, stage: int) -> tuple:
        """(pipeline rank, model chunk) holding virtual stage `stage`; the inverse of `stage_of`."""
        if self.v_shape:
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp

    def neighbours(self, stage: int) -> tuple:
        """(previous, next) virtual stage of `stage` as (pipeline rank, model chunk) each, None past an end."""
        previous = self.place(stage - 1) if stage > 0 else None
        following = self.place(stage + 1) if stage < self.stages - 1 else None
        return previous, following

    @property
    def loss_rank(self) -> int:
        """The pipeline rank whose last stage computes the loss: pp - 1, or 0 under the V."""
        return self.place(self.stages - 1)[0]

    @property
    def flags(self) -> list:
        """The launcher flags that ask for this schedule (none for the default)."""
        if self.pp == 1 or self.name == "1f1b":
            return []
        if self.kind.chunks is None:
            return [f"--virtual-pipeline-model-parallel-size {self.vpp}"]
        return [f"--pipeline-schedule {self.name}"]


@dataclass(frozen=True)
class Sharding:
    strategy: str = "no_shard"

    @classmethod
    def of(cls, strategy: Optional[str], distributed_optimizer: bool = False) -> "Sharding":
        """--data-parallel-sharding-strategy, else optim with --use-distributed-optimizer, else no_shard."""
        if strategy not in (None,) + SHARDING_STRATEGIES:
            raise ValueError(f"unknown sharding strategy {strategy!r}")
        return cls(strategy or ("optim" if distributed_optimizer else "no_shard"))

    @property
    def optimizer(self) -> bool:
        """fp32 masters and Adam state sharded over the replicas (ZeRO-1 and up: the distributed optimizer)."""
        return self.strategy != "no_shard"

    @property
    def grads(self) -> bool:
        """Gradients reduce-scattered per microbatch instead of kept whole (ZeRO-2 and up)."""
        return self.strategy in ("optim_grads", "optim_grads_params")

    @property
    def params(self) -> bool:
        """Weights stored sharded and gathered per unit for forward and backward (ZeRO-3)."""
        return self.strategy == "optim_grads_params"

    @property
    def flags(self) -> list:
        """The launcher flags that ask for this strategy (Megatron-LM's for ZeRO-1)."""
        if not self.optimizer:
            return []
        if self.strategy == "optim":
            return ["--use-distributed-optimizer"]
        return [f"--data-parallel-sharding-strategy {self.strategy}"]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"            # none | selective | full
    sequence_parallel: bool = False    # only with tp > 1 (resolved below)
    distributed_optimizer: bool = False
    first_stage_layers: Optional[int] = None   # uneven pipeline split (--decoder-first-pipeline-num-layers)
    last_stage_layers: Optional[int] = None
    cp: int = 1                        # context parallel: each sequence split over cp ranks
    ep: int = 1                        # expert parallel, carved from dp
    sharding_strategy: Optional[str] = None    # resolved below, with distributed_optimizer made to agree
    pipeline_schedule: Optional[str] = None    # resolved below, with vpp made to agree

    def __post_init__(self):
        schedule = PipelineSchedule.of(self.pipeline_schedule, self.pp, self.vpp)
        sharding = Sharding.of(self.sharding_strategy, self.distributed_optimizer)
        resolved = dict(pipeline_schedule=schedule.name, vpp=schedule.vpp, sharding_strategy=sharding.strategy,
                        distributed_optimizer=sharding.optimizer, sequence_parallel=self.sequence_parallel and self.tp > 1)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_schedule", schedule)
        object.__setattr__(self, "_sharding", sharding)

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "Layout":
        """The layout the flags ask for on `world_size` ranks."""
        par = cfg.parallel
        return cls(tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size, dp=cfg.dp(world_size),
                   vpp=par.virtual_pipeline_model_parallel_size or 1, micro_batch_size=cfg.training.micro_batch_size,
                   recompute=cfg.model.recompute_granularity or "none", sequence_parallel=par.sequence_parallel,
                   distributed_optimizer=par.use_distributed_optimizer,
                   first_stage_layers=par.decoder_first_pipeline_num_layers,
                   last_stage_layers=par.decoder_last_pipeline_num_layers, cp=par.context_parallel_size,
                   ep=par.expert_model_parallel_size, sharding_strategy=par.data_parallel_sharding_strategy,
                   pipeline_schedule=par.pipeline_schedule)

    @property
    def schedule(self) -> PipelineSchedule:
        return self._schedule

    @property
    def sharding(self) -> Sharding:
        return self._sharding

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks holding replicas of the same weights: gradients reduce, and sharded state splits, over them
        (dp x cp: CP ranks replicate the weights)."""
        return self.dp * self.cp

    @property
    def expert_shard_group(self) -> int:
        """Ranks holding the same experts (dp/ep x cp): expert gradients reduce, and their state shards, there."""
        return self.dp // self.ep * self.cp

    def stage_sizes(self, num_layers: int) -> list:
        """Layers per pipeline stage without interleaving: even, or the given first/last counts and the rest
        split evenly."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            return [num_layers // self.pp] * self.pp
        middle = self.pp - (first is not None) - (last is not None)
        each = (num_layers - (first or 0) - (last or 0)) // middle if middle else 0
        sizes = [each] * self.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def layer_ids(self, num_layers: int, rank: int, chunk: int) -> list:
        """Global ids of the layers in model chunk `chunk` on pipeline rank `rank`: with several chunks per
        rank the layers form pp x vpp equal virtual stages placed by the schedule."""
        if self.vpp > 1:
            per = num_layers // (self.pp * self.vpp)
            start = self.schedule.stage_of(rank, chunk) * per
            return list(range(start, start + per))
        sizes = self.stage_sizes(num_layers)
        start = sum(sizes[:rank])
        return list(range(start, start + sizes[rank]))

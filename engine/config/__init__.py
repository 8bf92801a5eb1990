"""Typed run configuration: dataclasses per concern with Megatron-LM flag names (`model`: the model's section,
`sections`: the others, `fields`: the error and how a field is declared; here: the whole `Config`). A
description only: it opens no file and imports nothing else of the engine.

Every field of every section is a command-line flag named after it (`num_layers` -> `--num-layers`);
YAML keys are the same names with `-` or `_`. engine/flags.py reads the flags off these sections and
engine/cli.py reads the command line and YAML files into a `Config` (flags given on the command line
override the file). engine/validation.py holds every check that can be made before any process group
exists; each failure is one `ConfigError` (raised by `_err`, here) naming the flag, the value and the fix.
What the flags leave to be derived (the vocabulary from the tokenizer, the global batch size from the
world) is filled in by engine/resolve.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from engine.config.fields import PIPELINE_SCHEDULES, SHARDING_STRATEGIES, TOKENIZER_TYPES, ConfigError, _err
from engine.config.model import (
    ModelConfig,
    moe_layer_pattern,
    padded_vocab_size,
    window_layer_pattern,
    window_size_pair,
)
from engine.config.sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    StabilityConfig,
    TrainingConfig,
)

SECTIONS = {
    "model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
    "optim": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
    "logging": LoggingConfig, "stability": StabilityConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    config_file: Optional[str] = None
    notices: list = field(default_factory=list)  # lines the launcher prints once (rank 0): choices made for the user
    # the line that lists the flags left unset whose default here is not Megatron-LM's (engine.flags.kept_defaults)
    defaults_note: Optional[str] = None
    # --vocab-size as given, kept by resolve() when a NullTokenizer adds its end-of-document id to it (so resolving
    # again does not add a second one)
    given_vocab_size: Optional[int] = None
    # the tokenizer's end-of-document id, filled in by resolve() when a flag reads document boundaries
    # (--eod-mask-loss, --reset-attention-mask, --reset-position-ids)
    eod_id: Optional[int] = None

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{name: SECTIONS[name](**d.get(name, {})) for name in SECTIONS})

    # Shorthands used all over the engine.
    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel_size

    def dp(self, world_size: int) -> int:
        """Data-parallel size: the model replicas of tp x cp x pp ranks in the world."""
        return world_size // (self.tp * self.cp * self.pp)


__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig",
           "ParallelConfig", "PIPELINE_SCHEDULES", "SECTIONS", "SHARDING_STRATEGIES", "StabilityConfig",
           "TOKENIZER_TYPES", "TrainingConfig", "_err", "moe_layer_pattern", "padded_vocab_size",
           "window_layer_pattern", "window_size_pair"]

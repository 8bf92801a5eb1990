"""The vocabulary of the configuration: its error, how a field is declared, and the names some flags choose
from (what each name means is the module that reads it: engine/layout.py for schedules and strategies)."""
from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """A user mistake in flags or files; the launcher prints it (one line per mistake) and exits 2."""


class Problems(list):
    """The lines of every mistake found so far, so that one message lists them all: each check runs through
    `check`, which keeps its ConfigError's lines and goes on; `raise_all` ends the run with them."""

    def check(self, fn, *args) -> bool:
        """Run one check; False (its lines kept) when it fails."""
        try:
            fn(*args)
            return True
        except ConfigError as e:
            self.extend(str(e).splitlines())
            return False

    def raise_all(self) -> None:
        if self:
            raise ConfigError("\n".join(dict.fromkeys(self)))  # in order, each line once


def _err(flag: str, value, fix: str):
    raise ConfigError(f"{flag} {value}: {fix}")


# --tokenizer-type, with Megatron-LM's names (engine.data.tokenizer_spec.TYPES: what each reads)
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


# The names --pipeline-schedule and --data-parallel-sharding-strategy take; what each means is engine/layout.py's.
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# --optimizer and Muon's flags, Megatron-LM's names (what each means is engine/optim/newton_schulz.py's); a
# coefficient type with the number of (a, b, c) sets its schedule repeats (validation needs it without torch)
OPTIMIZERS = ("adam", "muon")
MUON_COEFFICIENTS = {"quintic": 5, "simple": 1}
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")

# FP8 training, Megatron-LM's names (what each means is engine/fp8/'s); the Blackwell recipes are named to be
# refused in one line
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
FP8_BLACKWELL_RECIPES = ("mxfp8", "nvfp4")
FP8_AMAX_ALGOS = ("max", "most_recent")


class _Mark(str):
    """What a field's `megatron` says besides a value: see `_f`."""


AS_MEGATRON = _Mark("as Megatron-LM")       # Megatron-LM's flag, with Megatron-LM's default
MEGATRON_REQUIRED = _Mark("none, required")  # Megatron-LM's flag with no default there: its runs give it
OWN = _Mark("Ternion's own flag")           # no flag of Megatron-LM's


def _f(default, help, *, aliases=(), choices=None, nargs=None, action=None, type=None, yaml_only=False,
       megatron=AS_MEGATRON):
    """A config field. `yaml_only`: a structured value (e.g. a list of mappings) with no command-line form.
    `megatron`: Megatron-LM's default for the flag of this name where Ternion keeps another one (--help shows
    both, and the launcher notes each such flag a run leaves unset), or one of the marks above."""
    meta = dict(help=help, aliases=aliases, choices=choices, nargs=nargs, action=action, type=type,
                yaml_only=yaml_only, megatron=megatron)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)

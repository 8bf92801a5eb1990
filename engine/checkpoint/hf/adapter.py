"""What a Hugging Face family module declares: its config.json `Rule`s, and the `Adapter` bundling them with
the family's model shape and tensor plan. Each engine/checkpoint/hf/<model_type>.py defines one ADAPTER;
families.py registers it, and the import and export code reads nothing else about a family.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from engine.config import ConfigError


@dataclass(frozen=True)
class Rule:
    """One config.json key in both directions: its value from our ModelConfig (export), and the ModelConfig
    fields its value sets (import; a ConfigError where Ternion cannot express it)."""
    key: str
    out: Callable
    into: Callable


def same(key: str, field: str, out: Optional[Callable] = None) -> Rule:
    """A key that is one of our fields (exported resolved where `out` says how)."""
    return Rule(key, out or (lambda m: getattr(m, field)), lambda v: {field: v})


def only(key: str, value, why: str) -> Rule:
    """A key whose one value Ternion supports."""
    def into(v):
        if v != value:
            raise ConfigError(f"config.json {key}: {v!r}; Ternion supports {value!r} only ({why})")
        return {}
    return Rule(key, lambda m: value, into)


# Layer features a family has only where its shape names them: one that does not computes models without them.
PLAIN_LAYER = {"qk_layernorm": False, "norm_placement": "pre", "multi_latent_attention": False, "mtp_num_layers": None}


def has_shape(m, shape: dict) -> bool:
    """Whether ModelConfig `m` has every field of `shape` (and of PLAIN_LAYER where `shape` does not say). QKV
    biases count only without the other linear biases: with those, a family's own bias keys (Llama's
    attention_bias) cover q, k and v too."""
    facts = dataclasses.asdict(m) | {"add_qkv_bias": m.add_qkv_bias and m.disable_bias_linear}
    return all(facts[k] == v for k, v in (PLAIN_LAYER | shape).items())


def _as_written(values: dict) -> dict:
    return values


def _nothing_left_out(m) -> tuple:
    return ()


@dataclass(frozen=True)
class Adapter:
    """One transformers architecture, as export and import see it."""
    name: str           # the transformers class
    model_type: str
    shape: dict         # the ModelConfig fields every model of it has
    rules: tuple        # every config.json key it writes and reads
    defaults: dict      # what transformers assumes for a key config.json leaves out
    plan: Callable      # ModelConfig -> [(HF name, our name, Transform)]: the table both directions read
    fits: Callable      # ModelConfig -> whether the family computes the model exactly (export picks it)
    imports: tuple = ()                # the config.json model_types read as this family; none: export only
    windows: bool = False              # its rules carry a sliding window (export picks no other for a windowed model)
    prepare: Callable = _as_written    # config.json values (defaults filled in) -> as the rules read them
    moe: bool = False                  # listed in MOE_ARCHITECTURES rather than ARCHITECTURES
    left_out: Callable = _nothing_left_out  # ModelConfig -> (name prefix, why): tensors import leaves out, noted

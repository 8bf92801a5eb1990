"""Every config field as a command-line flag: its name, its section, its type and its default, read off the typed
sections of engine/config/ so that no list of flags is kept by hand.

engine/cli.py builds the parser and reads YAML keys with these; engine/megatron_flags.py and the messages of
engine/validation.py name flags with `flag_of`.
"""
from __future__ import annotations

import dataclasses
import shlex
import typing
from typing import Union

from engine.config import SECTIONS
from engine.config.fields import AS_MEGATRON, MEGATRON_REQUIRED, OWN


def all_fields():
    """(section name, dataclass field) for every flag."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def command_line(values: dict) -> str:
    """Field values as the flags that give them (a switch by its name alone), quoted for a shell."""
    parts = []
    for name, value in values.items():
        if value is True:
            parts.append(flag_of(name))
        elif value is not False and value is not None:
            parts.append(f"{flag_of(name)} {shlex.quote(str(value))}")  # '[0,1]' is a shell glob unquoted
    return " ".join(parts)


FIELD_SECTION = {f.name: section for section, f in all_fields()}
FIELDS = {f.name: f for _, f in all_fields()}
# Annotations are strings in engine/config/ (`from __future__ import annotations`); resolve them once.
_HINTS = {name: hint for cls in SECTIONS.values() for name, hint in typing.get_type_hints(cls).items()}


def field_type(f) -> type:
    """The field's type without Optional: bool, int, float, str or list."""
    t = _HINTS[f.name]
    if typing.get_origin(t) is Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def default_of(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def default_help(f) -> str:
    """The default as --help shows it, with Megatron-LM's beside it: '(default: 0.1, as Megatron-LM)',
    '(default: 1; Megatron-LM: 100)', or '(default: X)' for a flag of Ternion's own."""
    mark, ours = f.metadata["megatron"], default_of(f)
    if mark is OWN:
        return f"(default: {ours})"
    if mark is AS_MEGATRON:
        return f"(default: {ours}, as Megatron-LM)"
    return f"(default: {ours}; Megatron-LM: {mark})"


# the fields only multi-head latent attention reads (its YaRN included)
LATENT_ATTENTION_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                           "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim")


def kept_defaults(values: dict) -> list:
    """(flag, Ternion's default, Megatron-LM's) for each flag whose default here is not Megatron-LM's and which
    `values` (the flags and YAML keys given, by field name) leaves unset; MoE flags only for a MoE model, latent attention's only for an MLA model."""
    out = []
    for _, f in all_fields():
        mark = f.metadata["megatron"]
        if mark is OWN or mark is AS_MEGATRON or f.name in values:
            continue
        if f.name.startswith("moe_") and not values.get("num_experts"):
            continue
        if f.name in LATENT_ATTENTION_FIELDS and not values.get("multi_latent_attention"):
            continue
        if f.name == "train_iters" and values.get("train_samples"):
            continue  # the run's length is given in samples
        out.append((flag_of(f.name), default_of(f), "required" if mark is MEGATRON_REQUIRED else mark))
    return out

"""What differs between the model a checkpoint was trained as and the model this run builds, as flags.

A checkpoint records its whole `ModelConfig` (metadata.json's config). On resume every recorded field is
compared with the run's, as the model it makes: a default and the value it resolves to are the same model
(`--ffn-hidden-size` unset and 4 x hidden), and a setting the model does not use is not compared
(`--rotary-base` without RoPE, the router's settings without experts). What is left is a real change, named as
`(flag, checkpoint's value, this run's)`. The loader names these when tensors do not fit; engine/resolve.py
refuses the ones that keep every shape (`--moe-router-topk`, `--rotary-base`, ...) unless the user says the
change is meant.

Fields that change how the same model is computed, not what it computes, are not compared: the attention
kernel, recomputation, the initialisation (the checkpoint's weights replace it), the vocabulary padding (the
loader keeps the real rows) and the router's arithmetic precision (fp32 always here).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from engine.config.model import ModelConfig, moe_layer_pattern, window_layer_pattern, window_size_pair

NOT_COMPARED = frozenset({"attention_backend", "recompute_granularity", "recompute_num_layers", "init_method_std",
                          "make_vocab_size_divisible_by", "moe_router_dtype"})

_MOE_ONLY = frozenset({"moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                       "moe_router_topk", "moe_router_score_function", "moe_router_topk_scaling_factor",
                       "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                       "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                       "moe_token_drop_policy"})
_ROPE_ONLY = frozenset({"rotary_base", "use_rope_scaling"})
_ROPE_SCALING_ONLY = frozenset({"rope_scaling_factor", "rope_scaling_low_freq_factor",
                                "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings"})

# A field whose value the model reads only through what it resolves to.
_RESOLVED: dict = {
    "ffn_hidden_size": ModelConfig.resolved_ffn_hidden_size,
    "num_query_groups": ModelConfig.resolved_query_groups,
    "kv_channels": ModelConfig.head_dim,
    "max_position_embeddings": lambda m: m.max_position_embeddings or m.seq_length,
    "moe_ffn_hidden_size": ModelConfig.resolved_moe_ffn_hidden_size,
    "moe_layer_freq": lambda m: tuple(moe_layer_pattern(m.moe_layer_freq, m.num_layers)),
    "window_size": lambda m: window_size_pair(m.window_size),
    "window_attn_skip_freq": lambda m: tuple(window_layer_pattern(m.window_attn_skip_freq, m.num_layers)),
}


def _used(m: ModelConfig, name: str) -> bool:
    """Whether the model `m` describes reads field `name` at all."""
    if name in _MOE_ONLY:
        if not m.num_experts:
            return False
        if name == "moe_router_bias_update_rate":
            return m.moe_router_enable_expert_bias
        return name != "moe_token_drop_policy" or m.moe_expert_capacity_factor is not None
    rope = m.position_embedding_type == "rope"
    if name in _ROPE_ONLY:
        return rope
    if name in _ROPE_SCALING_ONLY:
        return rope and m.use_rope_scaling
    if name == "qk_layernorm_scope":
        return m.qk_layernorm
    if name == "openai_gelu":
        return not m.swiglu
    if name == "window_attn_skip_freq":
        return m.window_size is not None
    return True


def _as_model(m: ModelConfig, name: str):
    """Field `name` as the model of `m` uses it (None where it does not)."""
    if not _used(m, name):
        return None
    resolve: Optional[Callable] = _RESOLVED.get(name)
    try:
        return resolve(m) if resolve is not None else getattr(m, name)
    except (ValueError, TypeError):  # a recorded value this version cannot read: compare it as written
        return getattr(m, name)


def shown(value) -> str:
    """A value as the user would type it after the flag."""
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def model_differences(saved: dict, run: ModelConfig) -> list:
    """(flag, checkpoint's value, this run's) for every compared model field recorded in `saved` (a checkpoint's
    config["model"]) that makes a different model from `run`'s; fields the checkpoint does not record are
    skipped (an older checkpoint is compared on what it has)."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    known = {k: v for k, v in saved.items() if k in names}
    theirs = dataclasses.replace(run, **known)
    out = []
    for name in names:
        if name not in known or name in NOT_COMPARED or _used(theirs, name) != _used(run, name):
            continue  # used by one side only: the field that switches it on differs and is named
        old, new = _as_model(theirs, name), _as_model(run, name)
        if old != new:
            out.append(("--" + name.replace("_", "-"), _display(theirs, name, old), _display(run, name, new)))
    return out


def _display(m: ModelConfig, name: str, value):
    """What to show of a differing field: the number it resolves to, a per-layer pattern as it was written."""
    return getattr(m, name) if value is not None and name in _AS_WRITTEN else value


_AS_WRITTEN = frozenset({"moe_layer_freq", "window_size", "window_attn_skip_freq"})


def listing(differences: list) -> str:
    """'--flag OLD (this run: NEW), ...' for `model_differences`' output."""
    return ", ".join(f"{flag} {shown(old)} (this run: {shown(new)})" for flag, old, new in differences)

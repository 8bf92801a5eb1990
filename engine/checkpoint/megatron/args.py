"""A Megatron-LM run's saved `args` as Ternion flags, and a Ternion config as an `args` Namespace Megatron-LM takes.

Ternion's flags carry Megatron-LM's names and meanings, so most arguments are copied field for field (`COPIED`).
The rest are spelled differently (`--disable-bias-linear` is `not add_bias_linear`, `--num-query-groups` counts
only with `--group-query-attention`, lists become the strings Ternion's flags take) or describe a model Ternion
does not build: those are refused in one line naming the argument (`REFUSED`).

Multi-latent attention: megatron-core's MLA (MultiLatentAttention and YarnRotaryEmbedding, 0.16.1) multiplies
the rotated channels by mscale(f, mscale) / mscale(f, mscale_all_dim) under YaRN and the softmax scale by
mscale(f, mscale_all_dim)^2 whatever the RoPE; Ternion (as transformers) by the ratio only where both are set,
else mscale(f, 1), and the softmax only under YaRN. Where those differ for the run's values (`mla_scales_differ`)
the model is refused both ways. Megatron-LM has no flags for YaRN's original context and beta_fast / beta_slow
(megatron-core's MLA config keeps 4096, 32, 1): a model with others is refused on export.

The vocabulary is Megatron's padded one (`padded_vocab_size`): its softmax runs over every padded row, so the
same logits and loss need those rows to be Ternion's vocabulary too.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

import torch

from engine.checkpoint.megatron.pickled import Opaque
from engine.config import Config, ConfigError, moe_layer_pattern, window_layer_pattern, window_size_pair
from engine.rope import softmax_scale, yarn_mscale, yarn_rope_scale

SECTIONS = ("model", "optim", "training", "data")
NOT_COPIED = {"vocab_size", "num_query_groups", "disable_bias_linear", "attention_backend", "recompute_granularity",
              "recompute_num_layers", "z_loss_weight", "qk_layernorm_scope", "norm_placement",
              "mock_data", "data_phases", "device", "eod_mask_loss", "muon_no_split_qkv", "muon_nesterov"}
COPIED = {s: tuple(f.name for f in dataclasses.fields(type(getattr(Config(), s))) if f.name not in NOT_COPIED)
          for s in SECTIONS}
MODEL_FLAGS = COPIED["model"] + ("vocab_size", "num_query_groups", "disable_bias_linear")


def _on(args, name) -> bool:
    value = getattr(args, name, None)
    return bool(value.value if isinstance(value, Opaque) else value)


def _groups_by_top2(a) -> bool:
    """Whether a group-limited router ranks its groups by their top 2 scores (k = 2 x group top-k)."""
    topk, best = (v.value if isinstance(v, Opaque) else v
                  for v in (getattr(a, "moe_router_topk", None), getattr(a, "moe_router_group_topk", None)))
    return topk == 2 * (best or 0)


# (argument, is it set to something Ternion lacks, what to say)
REFUSED = (
    ("use_legacy_models", lambda a: _on(a, "use_legacy_models"),
     "a model of Megatron-LM's legacy code (megatron.legacy); only megatron-core GPT models are read"),
    ("fp8", lambda a: _on(a, "fp8"), "FP8 training state (scales, amax histories) has no place in a Ternion run yet"),
    ("apply_residual_connection_post_layernorm", lambda a: _on(a, "apply_residual_connection_post_layernorm"),
     "residuals taken after the norm are not built here"),
    ("apply_layernorm_1p", lambda a: _on(a, "apply_layernorm_1p"),
     "its norm weights are stored as w - 1 (zero-centred gamma), which is not converted"),
    ("squared_relu", lambda a: _on(a, "squared_relu"), "the squared-ReLU MLP is not built here"),
    ("rotary_interleaved", lambda a: _on(a, "rotary_interleaved"), "interleaved rotary pairs are not built here"),
    ("rotary_percent", lambda a: getattr(a, "rotary_percent", 1.0) != 1.0, "RoPE on part of each head is not built"),
    ("moe_router_pre_softmax", lambda a: _on(a, "moe_router_pre_softmax"),
     "un-renormalised pre-softmax routing weights are not built here"),
    ("moe_shared_expert_gate", lambda a: _on(a, "moe_shared_expert_gate"), "a gated shared expert is not built here"),
    ("moe_router_num_groups", lambda a: _on(a, "moe_router_num_groups") and not _groups_by_top2(a),
     "Megatron-Core ranks expert groups by the sum of their top k/M scores, Ternion (as DeepSeek-V3) by their top "
     "2: the same only when --moe-router-topk is twice --moe-router-group-topk"),
    ("optimizer", lambda a: getattr(a, "optimizer", "adam") not in ("adam", "muon", "dist_muon"),
     "only Adam(W) and Muon are built here"),
    ("start_weight_decay", lambda a: getattr(a, "weight_decay_incr_style", "constant") != "constant",
     "a weight decay that changes over the run is not built here (one --weight-decay)"),
    ("position_embedding_type", lambda a: getattr(a, "position_embedding_type", "learned_absolute") not in
     ("learned_absolute", "rope"), "only learned absolute and rotary positions are built here"),
)


def _value(name: str, value):
    """A Megatron argument as the Ternion flag of that name takes it."""
    if isinstance(value, Opaque):
        value = value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if name in ("moe_layer_freq", "window_attn_skip_freq") and value is not None:
        return f"[{','.join(str(int(v)) for v in value)}]" if isinstance(value, (list, tuple)) else str(value)
    if name == "window_size" and isinstance(value, (list, tuple)):
        return f"{value[0]},{value[1]}"
    if name == "lr_decay_style" and value == "WSD":
        return "wsd"
    if name == "rampup_batch_size" and value:
        return [int(v) for v in value]
    return value


def _core_mla_scales(m) -> tuple:
    """(factor on the rotated channels, factor on the softmax scale) of megatron-core's MLA for model `m`."""
    f = m.rotary_scaling_factor
    rope = yarn_mscale(f, m.mscale) / yarn_mscale(f, m.mscale_all_dim) if m.yarn() else 1.0
    return rope, yarn_mscale(f, m.mscale_all_dim) ** 2


def mla_scales_differ(m) -> Optional[str]:
    """Why megatron-core's MLA scales its RoPE channels or softmax otherwise than Ternion does for `m` (None: the
    same, or no MLA)."""
    if not m.multi_latent_attention:
        return None
    d = m.qk_head_dim + m.qk_pos_emb_head_dim
    ours, core = (yarn_rope_scale(m), softmax_scale(m, d) * d ** 0.5), _core_mla_scales(m)
    if all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(ours, core)):
        return None
    return (f"--rope-type {m.rope_type or 'yarn'} --rotary-scaling-factor {m.rotary_scaling_factor} "
            f"--mscale {m.mscale} --mscale-all-dim {m.mscale_all_dim}: megatron-core's MLA multiplies the rotated "
            f"channels by {core[0]:.6g} and the softmax scale by {core[1]:.6g}, Ternion by {ours[0]:.6g} and "
            f"{ours[1]:.6g}")


YARN_CORE = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}  # MLATransformerConfig


def config_from_args(args: argparse.Namespace, where: str) -> Config:
    """The Ternion config of a Megatron run; ConfigError (one line) for what Ternion does not build."""
    for name, refused, why in REFUSED:
        if refused(args):
            raise ConfigError(f"{where}: the run was saved with {name}={_value(name, getattr(args, name, None))!r}: "
                              f"{why}; Ternion cannot continue it")
    cfg = Config()
    for section, names in COPIED.items():
        fields = getattr(cfg, section)
        for name in names:
            if getattr(args, name, None) is not None:
                setattr(fields, name, _value(name, getattr(args, name)))
    o = cfg.optim  # Megatron-LM's Muon arguments by their dest names; its dist_muon is the same update, sharded
    o.optimizer = "muon" if o.optimizer == "dist_muon" else o.optimizer
    o.muon_no_split_qkv = not getattr(args, "muon_split_qkv", True)
    o.muon_nesterov = _on(args, "muon_use_nesterov")
    m = cfg.model
    m.vocab_size = getattr(args, "padded_vocab_size", None) or m.vocab_size
    m.disable_bias_linear = not getattr(args, "add_bias_linear", True)
    m.num_query_groups = args.num_query_groups if _on(args, "group_query_attention") else None
    if getattr(args, "recompute_granularity", None) in ("full", "selective"):
        m.recompute_granularity = args.recompute_granularity
    if not getattr(args, "add_position_embedding", True) and m.position_embedding_type == "learned_absolute":
        raise ConfigError(f"{where}: the run was saved without position embeddings (NoPE), which is not built here")
    if m.vocab_size is None:
        raise ConfigError(f"{where}: its args hold no padded_vocab_size; the embedding's rows cannot be checked")
    if mla_scales_differ(m):
        raise ConfigError(f"{where}: the run was saved with {mla_scales_differ(m)}; Ternion cannot continue it")
    return cfg


def run_flags(cfg: Config) -> dict:
    """The flags of the Megatron run that shape the model, the LR schedule and the batches (a --config file: the
    same flags continue the run), where they differ from Ternion's defaults; data paths and tokenizer are left to
    the resuming run."""
    default, out = Config(), {}
    for section, names in (("model", MODEL_FLAGS), ("optim", COPIED["optim"]), ("training", COPIED["training"])):
        for name in names:
            value = getattr(getattr(cfg, section), name)
            if value != getattr(getattr(default, section), name) or name in ("num_layers", "hidden_size", "vocab_size"):
                out[name] = value
    return out


def args_from_config(cfg: Config, tp: int, pp: int, extra: dict) -> argparse.Namespace:
    """The `args` Namespace of a Megatron-LM run of this model at tp x pp (what its load_checkpoint compares and
    what --use-checkpoint-args reads); `extra`: the data position (consumed samples)."""
    m, o, tr = cfg.model, cfg.optim, cfg.training
    if m.qk_layernorm and m.qk_layernorm_scope != "head" or m.norm_placement != "pre":
        raise ConfigError("--to-megatron: the model has QK-norm over whole projections or norms after the sublayers "
                          "(OLMo-2), which Megatron-LM's GPT model does not build")
    if mla_scales_differ(m):
        raise ConfigError(f"--to-megatron: {mla_scales_differ(m)}")
    kept = {k: getattr(m, k) for k in YARN_CORE if getattr(m, k) != YARN_CORE[k]}
    if m.yarn() and m.rotary_scaling_factor != 1 and kept:
        raise ConfigError(f"--to-megatron: YaRN with {', '.join(f'{k}={v}' for k, v in kept.items())}: Megatron-LM has "
                          f"no flags for these and its MLA keeps megatron-core's {YARN_CORE}")
    if m.moe_router_num_groups and m.moe_router_topk != 2 * m.moe_router_group_topk:
        raise ConfigError(f"--to-megatron: Megatron-Core ranks expert groups by their top k/M scores, not their top 2 "
                          f"as here: the same only when --moe-router-topk {m.moe_router_topk} is twice "
                          f"--moe-router-group-topk {m.moe_router_group_topk}")
    values = {n: getattr(getattr(cfg, s), n) for s, names in COPIED.items() for n in names}
    heads_per_group = m.num_attention_heads // m.resolved_query_groups()
    values.update(
        padded_vocab_size=m.padded_vocab_size(1), vocab_size=m.vocab_size, add_bias_linear=not m.disable_bias_linear,
        group_query_attention=heads_per_group > 1, num_query_groups=m.resolved_query_groups(),
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope", rotary_percent=1.0,
        rotary_interleaved=False, squared_relu=False, apply_layernorm_1p=False, apply_query_key_layer_scaling=False,
        kv_channels=m.head_dim(), ffn_hidden_size=m.resolved_ffn_hidden_size(), moe_router_pre_softmax=False,
        moe_grouped_gemm=bool(m.num_experts), moe_layer_freq=moe_layer_pattern(m.moe_layer_freq, m.num_layers),
        window_size=window_size_pair(m.window_size), window_attn_skip_freq=window_layer_pattern(
            m.window_attn_skip_freq, m.num_layers) if m.window_attn_skip_freq is not None else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1, context_parallel_size=1, world_size=tp * pp, data_parallel_size=1,
        use_distributed_optimizer=False, ckpt_format="torch_dist", use_dist_ckpt=True, no_save_optim=True,
        no_save_rng=True, params_dtype=torch.bfloat16 if tr.bf16 else torch.float16 if tr.fp16 else torch.float32,
        consumed_train_samples=int(extra.get("consumed_samples") or 0), skipped_train_samples=0,
        consumed_valid_samples=0, lr_decay_style="WSD" if o.lr_decay_style == "wsd" else o.lr_decay_style,
        muon_split_qkv=not o.muon_no_split_qkv, muon_use_nesterov=o.muon_nesterov,
        transformer_impl="transformer_engine", fp8=None)
    return argparse.Namespace(**values)

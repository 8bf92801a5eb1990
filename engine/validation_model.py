"""The model section's checks (engine/validation.py runs them first): the decoder on its own, before it is split.

Each failure is one `ConfigError` naming the flag, the value and the fix.
"""
from __future__ import annotations

from engine.config import ModelConfig, _err, window_layer_pattern, window_size_pair
from engine.flags import flag_of


def at_least_one(section, *names: str) -> None:
    for name in names:
        if getattr(section, name) is not None and getattr(section, name) < 1:  # None: unset, a default applies
            _err(flag_of(name), getattr(section, name), "must be at least 1")


def check_model(m: ModelConfig) -> None:
    """The model on its own, before it is split."""
    at_least_one(m, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    heads, groups = m.num_attention_heads, m.resolved_query_groups()
    if heads % groups:
        _err("--num-query-groups", groups, f"must divide --num-attention-heads {heads}")
    if not m.kv_channels and m.hidden_size % heads:
        _err("--hidden-size", m.hidden_size, f"must be a multiple of --num-attention-heads {heads}")
    if m.position_embedding_type == "rope" and m.rope_dim() % 2:
        _err("--qk-pos-emb-head-dim" if m.multi_latent_attention else "--kv-channels", m.rope_dim(),
             "rotary embeddings need an even number of channels")
    if m.position_embedding_type == "learned_absolute" and (m.max_position_embeddings or m.seq_length) < m.seq_length:
        _err("--max-position-embeddings", m.max_position_embeddings, f"must be at least --seq-length {m.seq_length}")
    if m.attention_backend == "triton" and m.attention_dropout > 0:
        _err("--attention-backend", "triton", "the Triton flash kernel has no dropout; use --attention-dropout 0 "
                                              "or --attention-backend sdpa")
    if window_size_pair(m.window_size) is None and m.window_attn_skip_freq is not None:
        _err("--window-attn-skip-freq", m.window_attn_skip_freq, "picks the layers without --window-size, which is "
                                                                 "not given; add --window-size L,0 or drop it")
    window_layer_pattern(m.window_attn_skip_freq, m.num_layers)  # one line where it does not parse
    if m.openai_gelu and m.swiglu:
        _err("--openai-gelu", "with --swiglu", "the GELU form applies to the GELU MLP only; drop one of them")
    if m.qk_layernorm_scope == "projection" and not (m.qk_layernorm and m.normalization == "RMSNorm"):
        _err("--qk-layernorm-scope", "projection", "is RMSNorm over the whole q and k projections (OLMo-2): add "
                                                   "--qk-layernorm and --normalization RMSNorm")
    if m.use_rope_scaling:
        _check_rope_scaling(m)
    _check_latent_attention(m)
    _check_groups(m)
    at_least_one(m, "mtp_num_layers")
    if m.mtp_num_layers and m.position_embedding_type != "rope":
        _err("--mtp-num-layers", m.mtp_num_layers, "multi-token prediction is built with rotary positions here (the "
                                                   "learned table lives on the first stage); use "
                                                   "--position-embedding-type rope")
    if m.mtp_loss_scaling_factor < 0:
        _err("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor, "must be at least 0 (DeepSeek-V3 uses 0.1-0.3)")


def _check_rope_scaling(m: ModelConfig) -> None:
    """Llama 3's scaling needs rotary positions and 0 < low freq factor < high freq factor."""
    if m.position_embedding_type != "rope":
        _err("--use-rope-scaling", "with --position-embedding-type learned_absolute", "needs rotary positions: add "
                                                                                    "--position-embedding-type rope")
    if m.rope_scaling_factor < 1:
        _err("--rope-scaling-factor", m.rope_scaling_factor, "must be at least 1 (Llama 3.1 uses 8)")
    if not 0 < m.rope_scaling_low_freq_factor < m.rope_scaling_high_freq_factor:
        _err("--rope-scaling-low-freq-factor", m.rope_scaling_low_freq_factor,
             f"must be positive and below --rope-scaling-high-freq-factor {m.rope_scaling_high_freq_factor}")
    at_least_one(m, "rope_scaling_original_max_position_embeddings")


def _check_latent_attention(m: ModelConfig) -> None:
    """MLA's sizes and what it is built with: rotary positions, one key/value head per query head, no biases."""
    if not m.multi_latent_attention:
        if m.q_lora_rank is not None or m.rope_type == "yarn":
            flag, value = ("--q-lora-rank", m.q_lora_rank) if m.q_lora_rank is not None else ("--rope-type", "yarn")
            _err(flag, value, "applies to multi-head latent attention only; add --multi-latent-attention or drop it")
        return
    at_least_one(m, "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "original_max_position_embeddings")
    if m.position_embedding_type != "rope":
        _err("--position-embedding-type", m.position_embedding_type, "multi-head latent attention rotates its "
                                                                     "decoupled part; use rope")
    if m.resolved_query_groups() != m.num_attention_heads:
        _err("--num-query-groups", m.num_query_groups, "multi-head latent attention gives every head its own key "
                                                       "and value; drop it")
    if m.qk_layernorm and m.qk_layernorm_scope != "head":
        _err("--qk-layernorm-scope", m.qk_layernorm_scope, "under --multi-latent-attention --qk-layernorm normalises "
                                                           "the q and kv latents (Megatron-LM's meaning); drop it")
    if m.use_rope_scaling:
        _err("--use-rope-scaling", "with --multi-latent-attention", "MLA's long-context scaling is YaRN: use "
                                                                    "--rotary-scaling-factor")
    if not m.disable_bias_linear or m.add_qkv_bias:
        _err("--disable-bias-linear", "not given", "multi-head latent attention's projections have no biases here; "
                                                   "add --disable-bias-linear")
    if m.rotary_scaling_factor < 1:
        _err("--rotary-scaling-factor", m.rotary_scaling_factor, "must be at least 1 (1: no extension; "
                                                                 "DeepSeek-V3: 40)")


def _check_groups(m: ModelConfig) -> None:
    """Group-limited routing: both flags, equal groups of experts, enough experts in the chosen groups."""
    groups, best = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and best is None:
        return
    if groups is None or best is None:
        given, missing = ("--moe-router-num-groups", "--moe-router-group-topk")[::1 if groups else -1]
        _err(given, groups or best, f"group-limited routing needs {missing} too; add it")
    at_least_one(m, "moe_router_num_groups", "moe_router_group_topk")
    if not m.num_experts or m.num_experts % groups:
        _err("--moe-router-num-groups", groups, f"must divide --num-experts {m.num_experts} (equal groups)")
    if best > groups:
        _err("--moe-router-group-topk", best, f"must be at most --moe-router-num-groups {groups}")
    if m.moe_router_topk > best * (m.num_experts // groups):
        _err("--moe-router-topk", m.moe_router_topk, f"exceeds the {best * (m.num_experts // groups)} experts of "
                                                     f"{best} groups; raise --moe-router-group-topk")

"""Qwen3ForCausalLM: Llama whose queries and keys are normalised per head (QK-norm: `self_attn.q_norm` and
`k_norm`, RMSNorm weights [head_dim]), with a head_dim of its own (config.json's, 128 where it is left out,
whatever hidden_size / num_attention_heads is) and no biases.

`attention_bias: true` puts a bias on q, k, v and o but none in the MLP, which Ternion's biases
(--disable-bias-linear, --add-qkv-bias) cannot express: refused. Its sliding window is Qwen2's (qwen2.py).
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, qwen2
from engine.checkpoint.hf.adapter import Adapter, has_shape, only
from engine.checkpoint.hf.transforms import WHOLE

SHAPE = llama.SHAPE | {"qk_layernorm": True, "qk_layernorm_scope": "head", "disable_bias_linear": True}
RULES = llama.RULES + (only("attention_bias", False, "no attention biases: q, k, v and o biases without MLP biases "
                                                    "are not a Ternion model"),)


def qk_norms(m, src: str, dst: str) -> list:
    """q's and k's norms (per head here, over the whole projection in OLMo-2: the same names)."""
    return [(f"{dst}self_attn.{x}_norm.weight", f"{src}attention.qk_norm.{x}.weight", WHOLE) for x in "qk"]


def projections(m, src: str, dst: str) -> list:
    """Llama's q/k/v, then q's and k's norms."""
    return llama.qkv(m, src, dst) + qk_norms(m, src, dst)


def plan(m) -> list:
    return llama.plan(m, lambda i, src, dst: llama.attention(m, src, dst, projections) + llama.mlp(m, src, dst))


ADAPTER = Adapter(
    "Qwen3ForCausalLM", "qwen3", SHAPE, RULES + qwen2.WINDOW_RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128,
     "attention_bias": False},
    plan, lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("qwen3",), windows=True, prepare=qwen2.layer_types)

"""Olmo2ForCausalLM: Llama with its norms after the sublayers, x + norm(f(x)) (`post_attention_layernorm` after
attention, our norm1; `post_feedforward_layernorm` after the MLP, our norm2; no input norm), and queries and
keys normalised over their whole projections (QK-norm: `self_attn.q_norm` [heads x head_dim], `k_norm`
[kv heads x head_dim]). No biases: `attention_bias: true` (q, k, v and o, none in the MLP) is refused.
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, qwen3
from engine.checkpoint.hf.adapter import Adapter, has_shape, only
from engine.checkpoint.hf.transforms import WHOLE

SHAPE = llama.SHAPE | {"qk_layernorm": True, "qk_layernorm_scope": "projection", "norm_placement": "post",
                       "disable_bias_linear": True}
RULES = llama.RULES + (only("attention_bias", False, "no attention biases: q, k, v and o biases without MLP biases "
                                                    "are not a Ternion model"),)


def layer(m, src: str, dst: str) -> list:
    """q/k/v and their norms, o_proj and the norm after it, the MLP and the norm after it."""
    return (qwen3.projections(m, src, dst)
            + [(dst + "self_attn.o_proj.weight", src + "attention.proj.weight", WHOLE),
               (dst + "post_attention_layernorm.weight", src + "norm1.weight", WHOLE)]
            + llama.mlp(m, src, dst) + [(dst + "post_feedforward_layernorm.weight", src + "norm2.weight", WHOLE)])


ADAPTER = Adapter(
    "Olmo2ForCausalLM", "olmo2", SHAPE, RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "attention_bias": False},
    lambda m: llama.plan(m, lambda i, src, dst: layer(m, src, dst)),
    lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("olmo2",), prepare=llama.rope_parameters)

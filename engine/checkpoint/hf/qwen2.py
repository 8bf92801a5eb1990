"""Qwen2ForCausalLM: Llama with q/k/v biases (and no other linear biases); the same tensors and rules.

Its sliding window, where `use_sliding_window` turns it on, bounds the imported --seq-length.
"""
from __future__ import annotations

from engine.checkpoint.hf import llama
from engine.checkpoint.hf.adapter import Adapter, has_shape

SHAPE = llama.SHAPE | {"add_qkv_bias": True, "disable_bias_linear": True}


def _window(hf: dict):
    return hf.get("sliding_window") if hf.get("use_sliding_window") else None


ADAPTER = Adapter(
    "Qwen2ForCausalLM", "qwen2", SHAPE, llama.RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    llama.plan, lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("qwen2",), window=_window, prepare=llama.rope_parameters)

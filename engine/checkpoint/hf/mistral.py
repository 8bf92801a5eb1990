"""MistralForCausalLM: Llama without biases, with a sliding window on every layer (`sliding_window` W, which
transformers assumes to be 4096 when config.json leaves it out, is --window-size W-1,0). Export picks it for
a Llama-shaped model with a window; one without goes out as Llama.
"""
from __future__ import annotations

from engine.checkpoint.hf import llama
from engine.checkpoint.hf.adapter import Adapter, has_shape

SHAPE = llama.SHAPE | {"disable_bias_linear": True}


def _default_window(values: dict) -> dict:
    """transformers' 4096 where config.json has no sliding_window; an explicit null stays no window (the
    adapter's defaults would replace it)."""
    return llama.rope_parameters({"sliding_window": 4096} | values)


ADAPTER = Adapter(
    "MistralForCausalLM", "mistral", SHAPE, llama.RULES + (llama.every_layer_window("MistralForCausalLM"),),
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
    llama.plan, lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("mistral",), windows=True, prepare=_default_window)

"""The one registry of Hugging Face families, and which family a model is in each direction.

A family is one module, engine/checkpoint/hf/<model_type>.py defining ADAPTER, and its entry in FAMILIES.
Export takes the first family, in FAMILIES' order, whose adapter fits the model; import the one whose
adapter lists config.json's model_type among its `imports`.
"""
from __future__ import annotations

from typing import Optional

from engine.checkpoint.hf import (deepseek_v3, gpt2, llama, mistral, mixtral, moe, olmo2, qwen2, qwen2_moe, qwen3,
                                  qwen3_moe)
from engine.config import ConfigError

FAMILIES = {a.model_type: a for a in (llama.ADAPTER, mistral.ADAPTER, qwen2.ADAPTER, gpt2.ADAPTER, mixtral.ADAPTER,
                                      qwen2_moe.ADAPTER, qwen3.ADAPTER, qwen3_moe.ADAPTER, olmo2.ADAPTER,
                                      deepseek_v3.ADAPTER)}
ARCHITECTURES = {key: a for key, a in FAMILIES.items() if not a.moe}
MOE_ARCHITECTURES = {key: a for key, a in FAMILIES.items() if a.moe}


def export_family(m) -> str:
    """The FAMILIES key of the family that computes ModelConfig `m` exactly; else one ConfigError line."""
    windowed = any(m.attention_window(i) is not None for i in range(m.num_layers))
    for key, adapter in FAMILIES.items():
        if adapter.fits(m) and (adapter.windows or not windowed):
            return key
    if m.multi_latent_attention:
        why = deepseek_v3.refusal(m) or f"the model has a sliding window (--window-size {m.window_size})"
        raise ConfigError(f"--format hf: {why}; transformers' DeepSeek-V3 cannot express it "
                          "exactly, use --format native")
    shaped = next((adapter.name for adapter in FAMILIES.values() if adapter.fits(m)), None)
    if shaped:
        raise ConfigError(f"--format hf: the model has a sliding window (--window-size {m.window_size}), which "
                          f"{shaped} cannot express here; use --format native")
    if m.num_experts:
        raise moe.refusal(m)
    raise ConfigError("--format hf: the model is neither Llama-shaped (RMSNorm, rope, swiglu; Qwen2 with "
                      "--add-qkv-bias --disable-bias-linear; Qwen3 with --qk-layernorm and no biases; OLMo-2 with "
                      "--qk-layernorm-scope projection --norm-placement post and no biases) nor GPT-2-shaped "
                      "(LayerNorm, learned positions, GELU, biases, tied embeddings, MHA); use --format native")


def imported_types() -> list:
    """Every config.json model_type some family imports."""
    return [t for adapter in FAMILIES.values() for t in adapter.imports]


def import_family(model_type: Optional[str]) -> Optional[str]:
    """The FAMILIES key a config.json of `model_type` imports as (None: none does)."""
    return next((key for key, adapter in FAMILIES.items() if model_type in adapter.imports), None)

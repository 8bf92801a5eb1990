"""Qwen2ForCausalLM: Llama with q/k/v biases (and no other linear biases); the same tensors and rules.

Its sliding window (Qwen3's too): `use_sliding_window` turns `sliding_window` W (--window-size W-1,0) on, for
the layers `layer_types` marks "sliding_attention"; without layer_types transformers gives the window to the
layers from `max_window_layers` on. Imported as --window-attn-skip-freq's 0/1 list; exported with both keys,
so a model whose windowed layers are not the last ones (what max_window_layers can say) is one line.
"""
from __future__ import annotations

from engine.checkpoint.hf import llama
from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape
from engine.config import ConfigError

SHAPE = llama.SHAPE | {"add_qkv_bias": True, "disable_bias_linear": True}
SLIDING, FULL = "sliding_attention", "full_attention"


def switched(values: dict) -> dict:
    """sliding_window as transformers reads it: None unless use_sliding_window."""
    return values | {"sliding_window": values.get("sliding_window") if values.get("use_sliding_window") else None}


def layer_types(values: dict) -> dict:
    """config.json as transformers 5 reads it (RoPE keys as llama.rope_parameters): sliding_window None unless
    use_sliding_window, and layer_types (from max_window_layers where absent) all full without a window."""
    values = switched(llama.rope_parameters(values))
    window, n = values["sliding_window"], values.get("num_hidden_layers", 0)
    types = values.get("layer_types") or [SLIDING if i >= values.get("max_window_layers", 28) else FULL
                                          for i in range(n)]
    if not window or SLIDING not in types:
        window, types = None, [FULL] * n
    return values | {"sliding_window": window, "layer_types": types}


def _skip_freq_into(types: list) -> dict:
    pattern = [int(t == SLIDING) for t in types]
    return {} if len(set(pattern)) < 2 else {"window_attn_skip_freq": str(pattern).replace(" ", "")}


def _full_layers_first(m) -> int:
    """max_window_layers: how many layers come before the windowed ones, where all of them do."""
    full = [left is None for left in llama.windows(m)]
    first = full.index(False) if False in full else len(full)
    if any(full[first:]):
        raise ConfigError(f"--format hf: max_window_layers gives the window to the layers from it on, and this "
                          f"model's windowed layers (--window-attn-skip-freq {m.window_attn_skip_freq}) are not the "
                          f"last ones; use --format native")
    return first


USE_SLIDING_WINDOW = Rule("use_sliding_window", lambda m: llama.sliding_window_out(m) is not None, lambda v: {})
WINDOW_RULES = (
    USE_SLIDING_WINDOW, Rule("sliding_window", llama.sliding_window_out, llama.sliding_window_into),
    Rule("max_window_layers", _full_layers_first, lambda v: {}),  # read through layer_types
    Rule("layer_types", lambda m: [FULL if left is None else SLIDING for left in llama.windows(m)], _skip_freq_into),
)

ADAPTER = Adapter(
    "Qwen2ForCausalLM", "qwen2", SHAPE, llama.RULES + WINDOW_RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    llama.plan, lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("qwen2",), windows=True, prepare=layer_types)

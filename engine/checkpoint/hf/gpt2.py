"""GPT2LMHeadModel: LayerNorm, learned positions, exact or tanh GELU, biases everywhere, tied embeddings and full
multi-head attention. Its Conv1D weights are [in, out], with q, k and v concatenated in c_attn.
"""
from __future__ import annotations

from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, only, same
from engine.checkpoint.hf.transforms import QKV, WHOLE, Transposed
from engine.config import ConfigError

GELU_FORMS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # exported: gelu or gelu_new


def _gelu_into(v) -> dict:
    if v not in GELU_FORMS:
        raise ConfigError(f"config.json activation_function: {v!r}; Ternion's GPT-2 MLP has {', '.join(GELU_FORMS)}")
    return {"openai_gelu": GELU_FORMS[v]}


RULES = (
    same("vocab_size", "vocab_size"), same("n_embd", "hidden_size"), same("n_layer", "num_layers"),
    same("n_head", "num_attention_heads"),
    same("n_inner", "ffn_hidden_size", lambda m: m.resolved_ffn_hidden_size()),
    same("n_positions", "max_position_embeddings", lambda m: m.max_position_embeddings or m.seq_length),
    same("layer_norm_epsilon", "norm_epsilon"), same("initializer_range", "init_method_std"),
    Rule("activation_function", lambda m: "gelu_new" if m.openai_gelu else "gelu", _gelu_into),
    same("resid_pdrop", "hidden_dropout"), Rule("embd_pdrop", lambda m: m.hidden_dropout, lambda v: {}),
    same("attn_pdrop", "attention_dropout"),
    only("tie_word_embeddings", True, "GPT-2-shaped models tie the output layer to the embedding"),
    only("scale_attn_weights", True, "attention scores are scaled by 1/sqrt(head dim)"),
    only("scale_attn_by_inverse_layer_idx", False, "no per-layer attention scaling"),
)
SHAPE = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
         "disable_bias_linear": False, "untie_embeddings_and_output_weights": False}


def _layer(src: str, dst: str, m) -> list:
    entries = [(f"{dst}ln_1.{kind}", f"{src}norm1.{kind}", WHOLE) for kind in ("weight", "bias")]
    entries += [(dst + "attn.c_attn.weight", src + "attention.qkv.weight", QKV.of(m, transposed=True)),
                (dst + "attn.c_attn.bias", src + "attention.qkv.bias", QKV.of(m)),
                (dst + "attn.c_proj.weight", src + "attention.proj.weight", Transposed()),
                (dst + "attn.c_proj.bias", src + "attention.proj.bias", WHOLE)]
    entries += [(f"{dst}ln_2.{kind}", f"{src}norm2.{kind}", WHOLE) for kind in ("weight", "bias")]
    return entries + [(dst + "mlp.c_fc.weight", src + "mlp.fc1.weight", Transposed()),
                      (dst + "mlp.c_fc.bias", src + "mlp.fc1.bias", WHOLE),
                      (dst + "mlp.c_proj.weight", src + "mlp.fc2.weight", Transposed()),
                      (dst + "mlp.c_proj.bias", src + "mlp.fc2.bias", WHOLE)]


def plan(m) -> list:
    """(HF name, our name, Transform) of every tensor."""
    entries = [("transformer.wte.weight", "word.weight", WHOLE), ("transformer.wpe.weight", "position", WHOLE)]
    for i in range(m.num_layers):
        entries += _layer(f"layers.{i}.", f"transformer.h.{i}.", m)
    return entries + [("transformer.ln_f.weight", "final_norm.weight", WHOLE),
                      ("transformer.ln_f.bias", "final_norm.bias", WHOLE)]


def _fits(m) -> bool:
    """GPT-2-shaped, with full multi-head attention of hidden_size / heads channels per head."""
    return (not m.num_experts and has_shape(m, SHAPE) and m.resolved_query_groups() == m.num_attention_heads
            and m.head_dim() * m.num_attention_heads == m.hidden_size)


ADAPTER = Adapter(
    "GPT2LMHeadModel", "gpt2", SHAPE, RULES,
    {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
     "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "resid_pdrop": 0.1, "attn_pdrop": 0.1,
     "n_positions": 1024},
    plan, _fits, imports=("gpt2",))

"""Export a checkpoint as a Hugging Face `transformers` model folder, one tensor at a time.

Llama-shaped models (RMSNorm, rotary, SwiGLU) become LlamaForCausalLM, GPT-2-shaped ones (LayerNorm,
learned positions, GELU, biases, tied embeddings, full multi-head attention) GPT2LMHeadModel. The
mapping follows each architecture's published parameter layout: Llama's q/k/v/o and gate/up/down
projections as [out, in]; GPT-2's Conv1D weights as [in, out] with q, k, v concatenated in c_attn.
Our fused QKV is group-interleaved ([g: q heads, k, v] per query group), so q head g*P+j uses k/v
head g, which is the order transformers' grouped-query attention expects. Both use rotate-half RoPE.
"""
from __future__ import annotations

import os

import torch

from engine.checkpoint import files
from engine.checkpoint.merged import full_unpadded, unpadded
from engine.checkpoint.reader import CheckpointReader
from engine.config import Config, ConfigError

WEIGHTS = "model.safetensors"


def architecture(cfg: Config) -> str:
    m = cfg.model
    if m.normalization == "RMSNorm" and m.position_embedding_type == "rope" and m.swiglu:
        return "llama"
    gpt2 = (m.normalization == "LayerNorm" and m.position_embedding_type == "learned_absolute" and not m.swiglu
            and not m.disable_bias_linear and not m.untie_embeddings_and_output_weights
            and m.resolved_query_groups() == m.num_attention_heads and m.head_dim() * m.num_attention_heads == m.hidden_size)
    if gpt2:
        return "gpt2"
    raise ConfigError("--format hf: the model is neither Llama-shaped (RMSNorm, rope, swiglu) nor GPT-2-shaped "
                      "(LayerNorm, learned positions, GELU, biases, tied embeddings, MHA); use --format native")


def _qkv_rows(m, part=None) -> torch.Tensor:
    """Row indices taking the group-interleaved fused QKV to q, k or v (part 0, 1, 2), or all three in turn."""
    groups, d = m.resolved_query_groups(), m.head_dim()
    per = m.num_attention_heads // groups
    rows = torch.arange(groups * (per + 2) * d).view(groups, per + 2, d)
    q, k, v = rows[:, :per].reshape(-1), rows[:, per].reshape(-1), rows[:, per + 1].reshape(-1)
    return torch.cat((q, k, v)) if part is None else (q, k, v)[part]


def _llama(reader: CheckpointReader, cfg: Config) -> tuple:
    m = cfg.model
    bias = not m.disable_bias_linear
    plan = [("model.embed_tokens.weight", "word.weight", None)]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        plan.append((dst + "input_layernorm.weight", src + "norm1.weight", None))
        for kind in ("weight",) + (("bias",) if bias else ()):
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                plan.append((f"{dst}self_attn.{proj}.{kind}", f"{src}attention.qkv.{kind}", ("qkv", j)))
            plan.append((f"{dst}self_attn.o_proj.{kind}", f"{src}attention.proj.{kind}", None))
        plan.append((dst + "post_attention_layernorm.weight", src + "norm2.weight", None))
        for kind in ("weight",) + (("bias",) if bias else ()):
            plan.append((f"{dst}mlp.gate_proj.{kind}", f"{src}mlp.fc1.{kind}", ("stack", 0)))
            plan.append((f"{dst}mlp.up_proj.{kind}", f"{src}mlp.fc1.{kind}", ("stack", 1)))
            plan.append((f"{dst}mlp.down_proj.{kind}", f"{src}mlp.fc2.{kind}", None))
    plan.append(("model.norm.weight", "final_norm.weight", None))
    tied = not m.untie_embeddings_and_output_weights
    if not tied:
        plan.append(("lm_head.weight", "output", None))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": reader.meta.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.resolved_ffn_hidden_size(),
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.resolved_query_groups(), "head_dim": m.head_dim(), "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings or m.seq_length, "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
        "tie_word_embeddings": tied, "attention_bias": bias, "mlp_bias": bias, "attention_dropout": 0.0,
    }
    return plan, config


def _gpt2(reader: CheckpointReader, cfg: Config) -> tuple:
    m = cfg.model
    plan = [("transformer.wte.weight", "word.weight", None), ("transformer.wpe.weight", "position", None)]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            plan.append((f"{dst}ln_1.{kind}", f"{src}norm1.{kind}", None))
        plan.append((dst + "attn.c_attn.weight", src + "attention.qkv.weight", ("qkv_cat_t", None)))
        plan.append((dst + "attn.c_attn.bias", src + "attention.qkv.bias", ("qkv_cat", None)))
        plan.append((dst + "attn.c_proj.weight", src + "attention.proj.weight", ("t", None)))
        plan.append((dst + "attn.c_proj.bias", src + "attention.proj.bias", None))
        for kind in ("weight", "bias"):
            plan.append((f"{dst}ln_2.{kind}", f"{src}norm2.{kind}", None))
        plan.append((dst + "mlp.c_fc.weight", src + "mlp.fc1.weight", ("t", None)))
        plan.append((dst + "mlp.c_fc.bias", src + "mlp.fc1.bias", None))
        plan.append((dst + "mlp.c_proj.weight", src + "mlp.fc2.weight", ("t", None)))
        plan.append((dst + "mlp.c_proj.bias", src + "mlp.fc2.bias", None))
    plan += [("transformer.ln_f.weight", "final_norm.weight", None), ("transformer.ln_f.bias", "final_norm.bias", None)]
    zero = 0.0
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": reader.meta.vocab_size,
        "n_positions": m.max_position_embeddings or m.seq_length, "n_embd": m.hidden_size, "n_layer": m.num_layers,
        "n_head": m.num_attention_heads, "n_inner": m.resolved_ffn_hidden_size(), "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_epsilon, "resid_pdrop": zero, "embd_pdrop": zero, "attn_pdrop": zero,
        "tie_word_embeddings": True,
    }
    return plan, config


def _transform(t: torch.Tensor, how, m) -> torch.Tensor:
    """One copy at most besides the transpose: peak memory stays near two copies of the tensor."""
    if how is None:
        return t
    kind, arg = how
    if kind == "stack":
        return t[arg]
    if kind == "t":
        return t.t().contiguous()
    picked = t.index_select(0, _qkv_rows(m, arg if kind == "qkv" else None))
    return picked.t().contiguous() if kind == "qkv_cat_t" else picked


def _out_shape(shape: tuple, how, m) -> tuple:
    return tuple(_transform(torch.empty(shape, device="meta"), how, m).shape)


def export_hf(reader: CheckpointReader, out_dir: str) -> str:
    """Write config.json and model.safetensors for transformers; return the architecture name."""
    import json
    cfg = Config.from_dict(reader.meta.config)
    arch = architecture(cfg)
    plan, config = (_llama if arch == "llama" else _gpt2)(reader, cfg)
    missing = [src for _, src, _ in plan if src not in reader.tensors]
    if missing:
        raise ConfigError(f"checkpoint {reader.path} has no tensor {missing[0]}; it does not look like a {arch} model")
    specs = []
    for dst, src, how in plan:
        shape, dtype = unpadded(reader, src)
        specs.append((dst, dtype, _out_shape(shape, how, cfg.model)))
    config["torch_dtype"] = config["dtype"] = str(specs[0][1]).removeprefix("torch.")  # old and new key names

    def tensors():
        current, full = None, None  # q, k and v come from one fused tensor: read it once
        for dst, src, how in plan:
            if current != src:
                full = None  # drop the previous tensor before reading the next
                current, full = src, full_unpadded(reader, src)
            yield dst, _transform(full, how, cfg.model).contiguous()

    os.makedirs(out_dir, exist_ok=True)
    files.write_safetensors(os.path.join(out_dir, WEIGHTS), specs, tensors(), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    return arch

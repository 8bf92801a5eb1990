"""LlamaForCausalLM: RMSNorm, rotary positions (optionally Llama 3.1's scaling), SwiGLU, grouped-query attention.

The projections are Linear weights [out, in]: q/k/v/o and gate/up/down. The rules, layer pieces and plan here
are the base the other Llama-shaped families (mistral, qwen2, mixtral, qwen2_moe) build on, among them the
sliding window as transformers writes it: `sliding_window` W counts the query itself, so it is --window-size
W-1,0.
"""
from __future__ import annotations

from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, only, same
from engine.checkpoint.hf.transforms import QKV, WHOLE, Part
from engine.config import ConfigError

# Llama 3 RoPE scaling: config.json rope_parameters key -> our field.
LLAMA3_ROPE = (("factor", "rope_scaling_factor"), ("low_freq_factor", "rope_scaling_low_freq_factor"),
               ("high_freq_factor", "rope_scaling_high_freq_factor"),
               ("original_max_position_embeddings", "rope_scaling_original_max_position_embeddings"))
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _rope_out(m) -> dict:
    rope = {"rope_type": "llama3" if m.use_rope_scaling else "default", "rope_theta": m.rotary_base}
    if m.use_rope_scaling:
        rope.update({hf: getattr(m, ours) for hf, ours in LLAMA3_ROPE})
    return rope


def _rope_into(rope: dict) -> dict:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConfigError(f"config.json rope type {kind!r}: Ternion has the default and Llama 3 ('llama3') RoPE only")
    fields = {"rotary_base": float(rope.get("rope_theta", 10000.0)), "use_rope_scaling": kind == "llama3"}
    if kind == "llama3":
        fields.update({ours: rope[hf] for hf, ours in LLAMA3_ROPE})
    return fields


def rope_parameters(values: dict) -> dict:
    """config.json in transformers 5's form: rope_theta and rope_scaling, the form before, as rope_parameters."""
    if values.get("rope_parameters"):
        return values
    return values | {"rope_parameters": {**(values.get("rope_scaling") or {}),
                                         "rope_theta": values.get("rope_theta", 1e4)}}


def _bias_into(v) -> dict:
    return {"disable_bias_linear": not v}


RULES = (  # every Llama-shaped family's keys
    same("vocab_size", "vocab_size"), same("hidden_size", "hidden_size"),
    same("intermediate_size", "ffn_hidden_size", lambda m: m.resolved_ffn_hidden_size()),
    same("num_hidden_layers", "num_layers"), same("num_attention_heads", "num_attention_heads"),
    same("num_key_value_heads", "num_query_groups", lambda m: m.resolved_query_groups()),
    same("head_dim", "kv_channels", lambda m: m.head_dim()),
    same("max_position_embeddings", "max_position_embeddings", lambda m: m.max_position_embeddings or m.seq_length),
    same("rms_norm_eps", "norm_epsilon"), same("attention_dropout", "attention_dropout"),
    same("initializer_range", "init_method_std"), only("hidden_act", "silu", "SwiGLU"),
    Rule("tie_word_embeddings", lambda m: not m.untie_embeddings_and_output_weights,
         lambda v: {"untie_embeddings_and_output_weights": not v}),
    # rope_theta and rope_scaling are what transformers before 5 reads; imported through rope_parameters
    Rule("rope_theta", lambda m: m.rotary_base, lambda v: {}),
    Rule("rope_scaling", lambda m: _rope_out(m) if m.use_rope_scaling else None, lambda v: {}),
    Rule("rope_parameters", _rope_out, _rope_into),
)
SHAPE = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True, "add_qkv_bias": False}


def _kinds(bias: bool) -> tuple:
    return ("weight",) + (("bias",) if bias else ())


def qkv(m, src: str, dst: str) -> list:
    """q, k and v projections (with biases where the model has them), each from our fused QKV."""
    entries = []
    for kind in _kinds(not m.disable_bias_linear or m.add_qkv_bias):
        for j, proj in enumerate(PROJECTIONS):
            entries.append((f"{dst}self_attn.{proj}.{kind}", f"{src}attention.qkv.{kind}", QKV.of(m, j)))
    return entries


def attention(m, src: str, dst: str, projections=qkv) -> list:
    """A layer's norm, q/k/v (`projections`), o_proj and the norm after; src/dst: our and HF's layer prefix."""
    entries = [(dst + "input_layernorm.weight", src + "norm1.weight", WHOLE)] + projections(m, src, dst)
    for kind in _kinds(not m.disable_bias_linear):
        entries.append((f"{dst}self_attn.o_proj.{kind}", f"{src}attention.proj.{kind}", WHOLE))
    return entries + [(dst + "post_attention_layernorm.weight", src + "norm2.weight", WHOLE)]


def mlp(m, src: str, dst: str) -> list:
    """The SwiGLU MLP: gate and up from our stacked fc1, down from fc2."""
    entries = []
    for kind in _kinds(not m.disable_bias_linear):
        entries.append((f"{dst}mlp.gate_proj.{kind}", f"{src}mlp.fc1.{kind}", Part(0)))
        entries.append((f"{dst}mlp.up_proj.{kind}", f"{src}mlp.fc1.{kind}", Part(1)))
        entries.append((f"{dst}mlp.down_proj.{kind}", f"{src}mlp.fc2.{kind}", WHOLE))
    return entries


def plan(m, layer=None) -> list:
    """(HF name, our name, Transform) of every tensor; `layer(i, src, dst)` gives layer i's (default Llama's)."""
    layer = layer or (lambda i, src, dst: attention(m, src, dst) + mlp(m, src, dst))
    entries = [("model.embed_tokens.weight", "word.weight", WHOLE)]
    for i in range(m.num_layers):
        entries += layer(i, f"layers.{i}.", f"model.layers.{i}.")
    entries.append(("model.norm.weight", "final_norm.weight", WHOLE))
    if m.untie_embeddings_and_output_weights:
        entries.append(("lm_head.weight", "output", WHOLE))
    return entries


def windows(m) -> list:
    """The window (--window-size's L) of each of the model's layers, None where a layer attends to all before it."""
    return [m.attention_window(i) for i in range(m.num_layers)]


def sliding_window_out(m):
    """config.json sliding_window (W = L + 1) of a model whose windowed layers share one L; None: no window."""
    return next((left + 1 for left in windows(m) if left is not None), None)


def sliding_window_into(v) -> dict:
    return {"window_size": f"{v - 1},0"} if v else {}


def every_layer_window(name: str) -> Rule:
    """`sliding_window` of a family that applies it to every layer (Mistral, Mixtral): a model with full
    attention on some layers and the window on others is one line."""
    def out(m):
        if len(set(windows(m))) > 1:
            raise ConfigError(f"--format hf: {name} applies its sliding window to every layer, and this model has "
                              f"full attention on some (--window-attn-skip-freq {m.window_attn_skip_freq}); use "
                              "--format native")
        return sliding_window_out(m)
    return Rule("sliding_window", out, sliding_window_into)


ADAPTER = Adapter(
    "LlamaForCausalLM", "llama", SHAPE,
    RULES + (Rule("attention_bias", lambda m: not m.disable_bias_linear, _bias_into),
             Rule("mlp_bias", lambda m: not m.disable_bias_linear, _bias_into)),
    {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
     "max_position_embeddings": 2048},
    plan, lambda m: not m.num_experts and has_shape(m, SHAPE),
    imports=("llama",), prepare=rope_parameters)

"""Hugging Face `transformers` model folders in and out, one tensor at a time, through one mapping table.

Export (`export_hf`, tools/merge_ckpt.py --format hf) writes a checkpoint as a folder `from_pretrained`
loads; import (`import_hf`, tools/convert_hf.py) writes such a folder (safetensors, sharded or not) as
iteration 0 of a checkpoint directory, which loads at any layout. Both read the same table: `_plan` gives
(HF name, our name, how) for every tensor, `_transform` applies `how` one way and `_place` the other; every
config.json key is a `Rule` with both directions (ARCHITECTURES), so each fact is written down once.

Llama-shaped models (RMSNorm, rotary with optional Llama 3.1 scaling, SwiGLU) are LlamaForCausalLM (Mistral
imports as one: the same tensors), with QKV biases only Qwen2ForCausalLM; GPT-2-shaped ones (LayerNorm,
learned positions, exact or tanh GELU, biases, tied embeddings, full multi-head attention) GPT2LMHeadModel.
The mapping follows each architecture's published parameter layout: Llama's q/k/v/o and gate/up/down
projections as [out, in]; GPT-2's Conv1D weights as [in, out] with q, k, v concatenated in c_attn.
Our fused QKV is group-interleaved ([g: q heads, k, v] per query group), so q head g*P+j uses k/v
head g, which is the order transformers' grouped-query attention expects. Both use rotate-half RoPE.
MoE models are MixtralForCausalLM or Qwen2MoeForCausalLM (engine/checkpoint/hf_moe.py: their expert
layouts, and what is refused).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine.checkpoint import files, hf_moe
from engine.checkpoint.layout import local_tensors, model_shard, shard_file
from engine.checkpoint.merged import full_unpadded, unpadded
from engine.checkpoint.metadata import CheckpointMeta, FileRecord, RankPart
from engine.checkpoint.reader import CheckpointReader
from engine.checkpoint.saver import publish
from engine.config import Config, ConfigError
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Rule:
    """One config.json key in both directions: its value from our ModelConfig (export), and the ModelConfig
    fields its value sets (import; a ConfigError where Ternion cannot express it)."""
    key: str
    out: Callable
    into: Callable


def _same(key: str, field: str, out: Optional[Callable] = None) -> Rule:
    """A key that is one of our fields (exported resolved where `out` says how)."""
    return Rule(key, out or (lambda m: getattr(m, field)), lambda v: {field: v})


def _only(key: str, value, why: str) -> Rule:
    """A key whose one value Ternion supports."""
    def into(v):
        if v != value:
            raise ConfigError(f"config.json {key}: {v!r}; Ternion supports {value!r} only ({why})")
        return {}
    return Rule(key, lambda m: value, into)


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


def _bias_into(v) -> dict:
    return {"disable_bias_linear": not v}


def _gelu_into(v) -> dict:
    if v not in GELU_FORMS:
        raise ConfigError(f"config.json activation_function: {v!r}; Ternion's GPT-2 MLP has {', '.join(GELU_FORMS)}")
    return {"openai_gelu": GELU_FORMS[v]}


# Llama 3 RoPE scaling: config.json rope_parameters key -> our field.
LLAMA3_ROPE = (("factor", "rope_scaling_factor"), ("low_freq_factor", "rope_scaling_low_freq_factor"),
               ("high_freq_factor", "rope_scaling_high_freq_factor"),
               ("original_max_position_embeddings", "rope_scaling_original_max_position_embeddings"))
GELU_FORMS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # exported: gelu or gelu_new

_LLAMA_RULES = (
    _same("vocab_size", "vocab_size"), _same("hidden_size", "hidden_size"),
    _same("intermediate_size", "ffn_hidden_size", lambda m: m.resolved_ffn_hidden_size()),
    _same("num_hidden_layers", "num_layers"), _same("num_attention_heads", "num_attention_heads"),
    _same("num_key_value_heads", "num_query_groups", lambda m: m.resolved_query_groups()),
    _same("head_dim", "kv_channels", lambda m: m.head_dim()),
    _same("max_position_embeddings", "max_position_embeddings", lambda m: m.max_position_embeddings or m.seq_length),
    _same("rms_norm_eps", "norm_epsilon"), _same("attention_dropout", "attention_dropout"),
    _same("initializer_range", "init_method_std"), _only("hidden_act", "silu", "SwiGLU"),
    Rule("tie_word_embeddings", lambda m: not m.untie_embeddings_and_output_weights,
         lambda v: {"untie_embeddings_and_output_weights": not v}),
    # rope_theta and rope_scaling are what transformers before 5 reads; imported through rope_parameters
    Rule("rope_theta", lambda m: m.rotary_base, lambda v: {}),
    Rule("rope_scaling", lambda m: _rope_out(m) if m.use_rope_scaling else None, lambda v: {}),
    Rule("rope_parameters", _rope_out, _rope_into),
)
_GPT2_RULES = (
    _same("vocab_size", "vocab_size"), _same("n_embd", "hidden_size"), _same("n_layer", "num_layers"),
    _same("n_head", "num_attention_heads"),
    _same("n_inner", "ffn_hidden_size", lambda m: m.resolved_ffn_hidden_size()),
    _same("n_positions", "max_position_embeddings", lambda m: m.max_position_embeddings or m.seq_length),
    _same("layer_norm_epsilon", "norm_epsilon"), _same("initializer_range", "init_method_std"),
    Rule("activation_function", lambda m: "gelu_new" if m.openai_gelu else "gelu", _gelu_into),
    _same("resid_pdrop", "hidden_dropout"), Rule("embd_pdrop", lambda m: m.hidden_dropout, lambda v: {}),
    _same("attn_pdrop", "attention_dropout"),
    _only("tie_word_embeddings", True, "GPT-2-shaped models tie the output layer to the embedding"),
    _only("scale_attn_weights", True, "attention scores are scaled by 1/sqrt(head dim)"),
    _only("scale_attn_by_inverse_layer_idx", False, "no per-layer attention scaling"),
)


@dataclass(frozen=True)
class Architecture:
    name: str        # the transformers class
    model_type: str
    shape: dict      # the ModelConfig fields every model of it has
    rules: tuple
    defaults: dict   # what transformers assumes for a key config.json leaves out


LLAMA_SHAPE = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True, "add_qkv_bias": False}
ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", LLAMA_SHAPE, _LLAMA_RULES + (
        Rule("attention_bias", lambda m: not m.disable_bias_linear, _bias_into),
        Rule("mlp_bias", lambda m: not m.disable_bias_linear, _bias_into)),
        {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 2048}),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", LLAMA_SHAPE | {"add_qkv_bias": True,
                                                                      "disable_bias_linear": True},
                          _LLAMA_RULES, {"tie_word_embeddings": False, "rms_norm_eps": 1e-6,
                                         "max_position_embeddings": 32768}),
    "gpt2": Architecture("GPT2LMHeadModel", "gpt2", {
        "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
        "disable_bias_linear": False, "untie_embeddings_and_output_weights": False}, _GPT2_RULES,
        {"n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
         "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "resid_pdrop": 0.1, "attn_pdrop": 0.1,
         "n_positions": 1024}),
}


def _dense_layers(m) -> list:
    return sorted(set(range(m.num_layers)) - set(m.moe_layers()))


_MIXTRAL_RULES = tuple(r for r in _LLAMA_RULES if r.key != "intermediate_size") + (
    Rule("intermediate_size", lambda m: m.resolved_moe_ffn_hidden_size(), lambda v: {"ffn_hidden_size": v}),
    _same("num_local_experts", "num_experts"), _same("num_experts_per_tok", "moe_router_topk"),
    Rule("router_jitter_noise", lambda m: 0.0, lambda v: {}),  # noise on training inputs only: not kept
    Rule("sliding_window", lambda m: None, lambda v: {}),  # imported through sliding_window()
)
_QWEN2_MOE_RULES = _LLAMA_RULES + (  # export only (hf_moe): `into` is never called for mlp_only_layers
    _same("num_experts", "num_experts"), _same("num_experts_per_tok", "moe_router_topk"),
    _same("moe_intermediate_size", "moe_ffn_hidden_size", lambda m: m.resolved_moe_ffn_hidden_size()),
    _same("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    Rule("mlp_only_layers", _dense_layers, lambda v: {}),
    _only("norm_topk_prob", True, "top-k routing weights are renormalised"),
    _only("decoder_sparse_step", 1, "MoE layers are the ones not in mlp_only_layers"),
    _only("qkv_bias", True, "zeros are written where the model has no QKV bias"),
    _only("use_sliding_window", False, "attention covers the whole sequence"),
)
MOE_SHAPE = LLAMA_SHAPE | {"disable_bias_linear": True}
MOE_ARCHITECTURES = {  # hf_moe.moe_architecture picks one; only Mixtral is imported
    hf_moe.MIXTRAL: Architecture("MixtralForCausalLM", "mixtral", MOE_SHAPE, _MIXTRAL_RULES, {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6,
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336}),
    hf_moe.QWEN2_MOE: Architecture("Qwen2MoeForCausalLM", "qwen2_moe", MOE_SHAPE, _QWEN2_MOE_RULES, {}),
}
_ALL = ARCHITECTURES | MOE_ARCHITECTURES
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
IMPORTED_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2",
                  "mixtral": "mixtral"}  # model_type -> ours


def architecture(cfg: Config) -> str:
    """The transformers architecture a model of `cfg` exports as (an ARCHITECTURES or MOE_ARCHITECTURES key)."""
    m = cfg.model
    if m.num_experts:
        return hf_moe.moe_architecture(m)
    facts = dataclasses.asdict(m) | {"add_qkv_bias": m.add_qkv_bias and m.disable_bias_linear}
    mha = m.resolved_query_groups() == m.num_attention_heads and m.head_dim() * m.num_attention_heads == m.hidden_size
    for name, arch in ARCHITECTURES.items():
        if all(facts[k] == v for k, v in arch.shape.items()) and (name != "gpt2" or mha):
            return name
    raise ConfigError("--format hf: the model is neither Llama-shaped (RMSNorm, rope, swiglu; Qwen2 with "
                      "--add-qkv-bias --disable-bias-linear) nor GPT-2-shaped (LayerNorm, learned positions, GELU, "
                      "biases, tied embeddings, MHA); use --format native")


def hf_config(arch: str, cfg: Config) -> dict:
    """config.json of the export: every rule's value. The special token ids are unknown (None) until the
    tokenizer names them (export_tokenizer): never transformers' GPT-2 default 50256 outside the vocabulary."""
    a, m = _ALL[arch], cfg.model
    config = {"architectures": [a.name], "model_type": a.model_type}
    return config | {rule.key: rule.out(m) for rule in a.rules} | dict.fromkeys(SPECIAL_IDS)


def model_fields(hf: dict) -> tuple:
    """(ARCHITECTURES key, ModelConfig fields) of a transformers config.json; ConfigError where Ternion differs."""
    kind = IMPORTED_TYPES.get(hf.get("model_type"))
    if kind is None:
        raise ConfigError(f"config.json model_type {hf.get('model_type')!r}: Ternion imports "
                          f"{', '.join(IMPORTED_TYPES)}")
    arch = _ALL[kind]
    values = {**arch.defaults, **{k: v for k, v in hf.items() if v is not None or k not in arch.defaults}}
    if kind != "gpt2" and not values.get("rope_parameters"):  # the format before transformers 5
        values["rope_parameters"] = {**(values.get("rope_scaling") or {}), "rope_theta": values.get("rope_theta", 1e4)}
    fields, set_by = dict(arch.shape), {}
    for rule in (r for r in arch.rules if r.key in values):
        for field, value in rule.into(values[rule.key]).items():
            if field in set_by and fields[field] != value:
                raise ConfigError(f"config.json {rule.key} {values[rule.key]!r} and {set_by[field]} "
                                  f"{values[set_by[field]]!r}: Ternion has one setting for both "
                                  f"(--{field.replace('_', '-')})")
            fields[field], set_by[field] = value, rule.key
    return kind, fields


def _plan(arch: str, m) -> list:
    """(HF name, our name, how) for every tensor: the table export and import both read."""
    if arch == "gpt2":
        return _gpt2_plan(m)
    bias, qkv_bias = not m.disable_bias_linear, not m.disable_bias_linear or m.add_qkv_bias
    plan, moe = [("model.embed_tokens.weight", "word.weight", None)], set(m.moe_layers())
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        plan.append((dst + "input_layernorm.weight", src + "norm1.weight", None))
        for kind in ("weight",) + (("bias",) if qkv_bias else ()):
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                plan.append((f"{dst}self_attn.{proj}.{kind}", f"{src}attention.qkv.{kind}", ("qkv", j)))
        if arch == hf_moe.QWEN2_MOE and not qkv_bias:  # its loaders expect q/k/v biases: zeros are exact
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                plan.append((f"{dst}self_attn.{proj}.bias", f"{src}attention.qkv.weight",
                             ("zero_bias", len(_qkv_rows(m, j)))))
        for kind in ("weight",) + (("bias",) if bias else ()):
            plan.append((f"{dst}self_attn.o_proj.{kind}", f"{src}attention.proj.{kind}", None))
        plan.append((dst + "post_attention_layernorm.weight", src + "norm2.weight", None))
        if i in moe:
            plan += hf_moe.moe_plan(arch, m, src, dst)
            continue
        for kind in ("weight",) + (("bias",) if bias else ()):
            plan.append((f"{dst}mlp.gate_proj.{kind}", f"{src}mlp.fc1.{kind}", ("stack", 0)))
            plan.append((f"{dst}mlp.up_proj.{kind}", f"{src}mlp.fc1.{kind}", ("stack", 1)))
            plan.append((f"{dst}mlp.down_proj.{kind}", f"{src}mlp.fc2.{kind}", None))
    plan.append(("model.norm.weight", "final_norm.weight", None))
    if m.untie_embeddings_and_output_weights:
        plan.append(("lm_head.weight", "output", None))
    return plan


def _gpt2_plan(m) -> list:
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
    return plan + [("transformer.ln_f.weight", "final_norm.weight", None),
                   ("transformer.ln_f.bias", "final_norm.bias", None)]


def _qkv_rows(m, part=None) -> torch.Tensor:
    """Row indices taking the group-interleaved fused QKV to q, k or v (part 0, 1, 2), or all three in turn."""
    groups, d = m.resolved_query_groups(), m.head_dim()
    per = m.num_attention_heads // groups
    rows = torch.arange(groups * (per + 2) * d).view(groups, per + 2, d)
    q, k, v = rows[:, :per].reshape(-1), rows[:, per].reshape(-1), rows[:, per + 1].reshape(-1)
    return torch.cat((q, k, v)) if part is None else (q, k, v)[part]


def _transform(t: torch.Tensor, how, m) -> torch.Tensor:
    """One copy at most besides the transpose: peak memory stays near two copies of the tensor."""
    if how is None:
        return t
    kind, arg = how
    if kind in hf_moe.KINDS:
        return hf_moe.transform(t, how, m)
    if kind == "stack":
        return t[arg]
    if kind == "t":
        return t.t().contiguous()
    picked = t.index_select(0, _qkv_rows(m, arg if kind == "qkv" else None))
    return picked.t().contiguous() if kind == "qkv_cat_t" else picked


def _out_shape(shape: tuple, how, m) -> tuple:
    return tuple(_transform(torch.empty(shape, device="meta"), how, m).shape)


def _place(full: torch.Tensor, t: torch.Tensor, how, m) -> None:
    """The inverse of `_transform`: put the HF tensor `t` where it came from in our (unpadded) tensor `full`."""
    kind, arg = how or (None, None)
    if kind in hf_moe.KINDS:
        hf_moe.place(full, t, how, m)
    elif kind == "stack":
        full[arg].copy_(t)
    elif kind in ("qkv", "qkv_cat", "qkv_cat_t"):
        full.index_copy_(0, _qkv_rows(m, arg if kind == "qkv" else None), t.t() if kind == "qkv_cat_t" else t)
    else:
        full.copy_(t.t() if kind == "t" else t)


def export_tokenizer(cfg: Config, ckpt_dir: str, out_dir: str) -> dict:
    """Write the run's tokenizer (any --tokenizer-type, found as saved in its config or by name beside the
    checkpoint) so that AutoTokenizer.from_pretrained(out_dir) encodes text to the ids it trained on; return its
    bos/eos/pad ids for config.json ({} when the run had none, e.g. mock data). `cfg.model.vocab_size` is the
    checkpoint's. A tokenizer that is gone or does not fit the model is one ConfigError line."""
    from engine.data.tokenizer_spec import run_tokenizer_spec
    vocab, near = cfg.model.vocab_size, [ckpt_dir, os.path.dirname(os.path.abspath(ckpt_dir))]
    try:
        spec = run_tokenizer_spec(cfg.to_dict()["data"], vocab, near=near)
        tok = spec.build() if spec is not None else None
    except ConfigError as e:
        raise ConfigError(f"--format hf: the run's tokenizer cannot be exported: {e} (also looked for beside "
                          f"{near[1]}); put it back, or use --format native") from None
    if tok is None:
        return {}
    if tok.vocab_size > vocab:
        raise ConfigError(f"--format hf: the run's tokenizer ({tok.source}) has {tok.vocab_size} ids but the model "
                          f"{vocab}; it is not the tokenizer the model was trained with")
    return tok.save_pretrained(out_dir)


def export_hf(reader: CheckpointReader, out_dir: str) -> str:
    """Write config.json and model.safetensors for transformers; return the architecture name."""
    cfg = Config.from_dict(reader.meta.config)
    cfg.model.vocab_size = reader.meta.vocab_size or cfg.model.vocab_size
    arch = architecture(cfg)
    plan, config = _plan(arch, cfg.model), hf_config(arch, cfg)
    missing = [src for _, src, _ in plan if src not in reader.tensors]
    if missing:
        raise ConfigError(f"checkpoint {reader.path} has no tensor {missing[0]}; it does not look like a {arch} model")
    specs = []
    for dst, src, how in plan:
        shape, dtype = unpadded(reader, src)
        specs.append((dst, dtype, _out_shape(shape, how, cfg.model)))
    config["torch_dtype"] = config["dtype"] = str(specs[0][1]).removeprefix("torch.")  # old and new key names
    config.update(export_tokenizer(cfg, reader.path, out_dir))

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


# ---------------------------------------------------------------------------------------------- import
DEFAULT_SEQ_LENGTH = 4096  # the imported run's --seq-length unless given (capped by the model's positions)
_CODE_DTYPES = {code: dtype for dtype, code in files.DTYPE_CODES.items()}
_UNUSED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers some checkpoints hold


class HFWeights:
    """The tensors of a transformers folder: model.safetensors, or the shards model.safetensors.index.json names.

    Plain reads (files.TensorFile), one tensor at a time. Names are found with or without the `model.` /
    `transformer.` prefix (a GPT-2 saved as GPT2Model, as the original one is, has none)."""

    def __init__(self, hf_dir: str):
        index, single = os.path.join(hf_dir, "model.safetensors.index.json"), os.path.join(hf_dir, WEIGHTS)
        if os.path.isfile(index):
            shards = {name: os.path.join(hf_dir, f) for name, f in (_read_json(index).get("weight_map") or {}).items()}
        elif os.path.isfile(single):
            shards = dict.fromkeys(files.TensorFile(single).keys(), single)
        else:
            raise ConfigError(f"--hf {hf_dir}: no {WEIGHTS} or model.safetensors.index.json; save the model with "
                              "save_pretrained (safetensors is its default)")
        opened = {}
        for path in sorted(set(shards.values())):
            if not os.path.isfile(path):
                raise ConfigError(f"--hf {hf_dir}: {path}, named by model.safetensors.index.json, is missing")
            opened[path] = files.TensorFile(path)
        self.where = {name: opened[path] for name, path in shards.items()}
        absent = [name for name, f in self.where.items() if name not in f.entries]
        if absent:
            raise ConfigError(f"--hf {hf_dir}: tensor {absent[0]} is not in {shards[absent[0]]}, where the index "
                              "puts it")

    def key(self, name: str) -> Optional[str]:
        if name in self.where:
            return name
        short = name.split(".", 1)[1] if name.startswith(("model.", "transformer.")) else None
        return short if short in self.where else None

    def shape(self, key: str) -> tuple:
        return self.where[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return _CODE_DTYPES[self.where[key].entries[key]["dtype"]]

    def read(self, key: str) -> torch.Tensor:
        return self.where[key].read(key)


def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError:
        raise ConfigError(f"{path} not found; --hf takes a folder written by save_pretrained") from None
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON") from None


def sliding_window(hf: dict) -> Optional[int]:
    """The attention window of a Mistral, Mixtral or Qwen2 config (None: full causal attention)."""
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window") if hf.get("model_type") in ("mistral", "qwen2", "mixtral") else None


def imported_config(hf: dict, seq_length: Optional[int] = None) -> tuple:
    """(ARCHITECTURES key, run Config, the ModelConfig fields set) of a transformers config.json, at `seq_length`
    (default: the model's positions, at most DEFAULT_SEQ_LENGTH and its attention window)."""
    arch, fields = model_fields(hf)
    cfg = Config()
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    m, window = cfg.model, sliding_window(hf)
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length {seq_length}: must be at least 1")
    m.seq_length = seq_length or min(n for n in (m.max_position_embeddings, window, DEFAULT_SEQ_LENGTH) if n)
    if window and window < m.seq_length:
        raise ConfigError(f"--seq-length {m.seq_length}: {hf.get('model_type')} attends to a sliding window of "
                          f"{window} tokens and Ternion to the whole sequence; use --seq-length {window} or less")
    if arch == "gpt2" and m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length}: the model has {m.max_position_embeddings} learned positions "
                          "(n_positions); use at most that")
    return arch, cfg, [f.name for f in dataclasses.fields(m) if f.name in fields or f.name == "seq_length"]


def import_hf(hf_dir: str, out_dir: str, seq_length: Optional[int] = None, data: Optional[dict] = None) -> tuple:
    """Write the transformers model in `hf_dir` as iteration 0 of the checkpoint directory `out_dir` (saved at
    tp 1 x pp 1; it loads at any layout); return (the run Config, the names of the model flags that describe
    it). `data`: DataConfig fields to record (the tokenizer). Names and shapes are all checked before writing."""
    arch, cfg, names = imported_config(_read_json(os.path.join(hf_dir, "config.json")), seq_length)
    for name, value in (data or {}).items():
        setattr(cfg.data, name, value)
    m, weights, ctx = cfg.model, HFWeights(hf_dir), ParallelContext.virtual()
    tensors = [lt for lt in local_tensors(build_model_chunks(cfg, ctx, device="meta"), ctx) if lt.writer]
    sources = _sources(_plan(arch, m), tensors, weights, m, hf_dir)
    dtypes = {lt.name: weights.dtype(sources[lt.name][0][0]) for lt in tensors}
    if files.read_latest(out_dir) is not None or files.list_iterations(out_dir):
        raise ConfigError(f"--out {out_dir}: already holds a checkpoint; give a new directory")
    os.makedirs(out_dir, exist_ok=True)
    files.remove_stale(out_dir)
    tmp, name = os.path.join(out_dir, files.iter_dir_name(0) + ".tmp"), shard_file("model", 0, 0)
    os.makedirs(tmp)
    specs = [(lt.name, dtypes[lt.name], lt.full_shape) for lt in tensors]
    produced = ((lt.name, _gather(lt, sources[lt.name], weights, m, dtypes[lt.name])) for lt in tensors)
    sha = files.write_safetensors(os.path.join(tmp, name), specs, produced)
    part = RankPart(0, model={lt.name: model_shard(lt, dtypes[lt.name], 0, 0, name) for lt in tensors}, files=[name])
    meta = CheckpointMeta.build([part], 0, ctx, cfg.to_dict(), {"consumed_samples": 0})
    meta.files = {name: FileRecord(os.path.getsize(os.path.join(tmp, name)), sha)}
    publish(out_dir, tmp, 0, meta)
    return cfg, names


def _sources(plan: list, tensors: list, weights: HFWeights, m, hf_dir: str) -> dict:
    """Our name -> [(HF key, how)]; every HF tensor present with the shape config.json implies, none left over."""
    sources, used = {}, set()
    for hf_name, ours, how in plan:
        key = weights.key(hf_name)
        if key is None:
            raise ConfigError(f"--hf {hf_dir}: no tensor {hf_name}, which its config.json implies")
        sources.setdefault(ours, []).append((key, how))
        used.add(key)
    for lt in tensors:
        shape = (lt.valid_rows,) + lt.full_shape[1:] if lt.valid_rows else lt.full_shape
        for key, how in sources[lt.name]:
            want = _out_shape(shape, how, m)
            if weights.shape(key) != want:
                raise ConfigError(f"--hf {hf_dir}: tensor {key} has shape {weights.shape(key)} but its config.json "
                                  f"implies {want}")
    if not m.untie_embeddings_and_output_weights:
        used.add("lm_head.weight")  # the tied output layer: some files hold a copy of the embedding
    left = [k for k in weights.where if k not in used and not k.endswith(_UNUSED)]
    if left:
        raise ConfigError(f"--hf {hf_dir}: tensor {left[0]} has no place in a Ternion model of its config.json")
    return sources


def _gather(lt, sources: list, weights: HFWeights, m, dtype: torch.dtype) -> torch.Tensor:
    """One of our tensors, whole and vocabulary-padded, from its HF tensors (one of them in memory at a time)."""
    full = torch.zeros(lt.full_shape, dtype=dtype)
    for key, how in sources:
        _place(full[: lt.valid_rows] if lt.valid_rows else full, weights.read(key).to(dtype), how, m)
    return full

"""Which Megatron-Core tensor each Ternion tensor is, one table for every architecture: GPT (LayerNorm, learned
positions, GELU, biases), Llama-style (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, QK-norm), MoE
(router, expert bias, routed experts as one grouped tensor, shared expert), multi-latent attention (with and
without a q latent, the latent norms) and multi-token prediction modules, each piece where the model has it.

Names are Megatron-Core's sharded keys with the layer number written in: `decoder.layers.{i}.<name>` stands for
layer i of the stacked `decoder.layers.<name>` [num_layers, ...] (or the per-layer key a model with dense and MoE
layers mixed is saved under); MTP module k's are `mtp.layers.{k}.<name>`, never stacked (its transformer layer
under `mtp.layers.{k}.transformer_layer.`). Some tensors have two names, the Transformer Engine spec's and the
local spec's (norms fused into the next linear, or a separate module); readers take the one present, the writer
writes the first, or both where the local spec does not rename its own to the first (`Entry.both`: an MoE layer's
pre-MLP norm; under MLA the latent norms and the pre-MLP norm, as the local MLA spec has no
sharded_state_dict_keys_map): each spec loads its own and ignores the other.

What was checked against megatron-core 0.16.1 (tests/test_megatron_checkpoint.py): linear_qkv's rows are
Ternion's own group-interleaved order ([g: the group's query heads, its key, its value] per query group: both
split by query groups over tp); SwiGLU's linear_fc1 is [gate; up] over the whole tensor (the sharded form
stores every tp rank's gate before every up), Ternion's [2, F, h] stack; experts are [E, out, in] by global
expert id, Ternion's fc1 [E, h, F1] / fc2 [E, F, h] transposed. MLA (MLASelfAttention): linear_q_proj or
linear_q_down_proj / q_layernorm / linear_q_up_proj, linear_kv_down_proj (the kv latent's rows, then the RoPE
key's) / kv_layernorm / linear_kv_up_proj (each head's key rows, then its value rows), linear_proj, Ternion's
q / q_down / q_norm / q_up / kv_down / kv_norm / kv_up / proj; megatron-core rotates the RoPE rows in
interleaved pairs (_apply_rotary_pos_emb_bshd de-interleaves them under multi_latent_attention), Ternion in
halves: those rows of q and of kv_down are reordered (InterleavedRope, as for DeepSeek's own files). MTP
(MultiTokenPredictionLayer): enorm, hnorm, eh_proj [h, 2h] over [embedding; hidden], transformer_layer,
final_layernorm: Ternion's embedding_norm, hidden_norm, proj, layer, final_norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoint.hf.transforms import WHOLE, InterleavedRope, Transform


class Flattened(Transform):
    """Ternion's stacked [2, F, ...] (SwiGLU's gate and up) as Megatron's [2F, ...]."""

    def out(self, t):
        return t.reshape(-1, *t.shape[2:])

    def into(self, full, t):
        full.copy_(t.view(full.shape))


class ExpertsT(Transform):
    """Ternion's experts [E, in, out] as Megatron's [E, out, in]."""

    def out(self, t):
        return t.transpose(1, 2).contiguous()

    def into(self, full, t):
        full.copy_(t.transpose(1, 2))


FLATTENED, EXPERTS_T = Flattened(), ExpertsT()
EXPERTS_KEY = "mlp.experts.experts."  # routed experts: [E, ...] by global expert id after the layer axis


@dataclass(frozen=True)
class Entry:
    ours: str           # the Ternion tensor
    names: tuple        # its Megatron names, the one the writer uses first
    how: Transform
    both: bool = False  # the writer writes every name (each spec loads its own)


def _biased(ours: str, names, how=WHOLE, bias: bool = False) -> list:
    """The weight, and the bias where the model has one."""
    names = (names,) if isinstance(names, str) else names
    out = [Entry(f"{ours}.weight", tuple(f"{n}weight" for n in names), how)]
    if bias:
        out.append(Entry(f"{ours}.bias", tuple(f"{n}bias" for n in names), how))
    return out


def _norm(m, ours: str, names: tuple, both: bool = False) -> list:
    return [Entry(f"{ours}.{kind}", tuple(f"{n}{kind}" for n in names), WHOLE, both)
            for kind in ("weight", "bias")[: 2 if m.normalization == "LayerNorm" else 1]]


def _mlp(m, ours: str, megatron: str) -> list:
    bias = not m.disable_bias_linear
    return (_biased(f"{ours}.fc1", f"{megatron}linear_fc1.", FLATTENED if m.swiglu else WHOLE, bias)
            + _biased(f"{ours}.fc2", f"{megatron}linear_fc2.", WHOLE, bias))


def _moe(m, ours: str, megatron: str) -> list:
    out = [Entry(f"{ours}.router.weight", (f"{megatron}router.weight",), WHOLE),
           Entry(f"{ours}.experts.fc1", (f"{megatron}experts.experts.linear_fc1.weight",), EXPERTS_T),
           Entry(f"{ours}.experts.fc2", (f"{megatron}experts.experts.linear_fc2.weight",), EXPERTS_T)]
    if m.moe_router_enable_expert_bias:
        out.append(Entry(f"{ours}.router.expert_bias", (f"{megatron}router.expert_bias",), WHOLE))
    if m.moe_shared_expert_intermediate_size:
        out += _mlp(m, f"{ours}.shared", f"{megatron}shared_experts.")
    return out


def _attention(m, ours: str, attn: str) -> list:
    """Self-attention's tensors: linear_qkv (and the per-head QK-norms), or MLA's projections and latent norms."""
    if not m.multi_latent_attention:
        out = _biased(ours + "qkv", f"{attn}linear_qkv.", WHOLE, not m.disable_bias_linear or m.add_qkv_bias)
        if m.qk_layernorm:
            out += [e for x in "qk" for e in _norm(m, f"{ours}qk_norm.{x}", (f"{attn}{x}_layernorm.",))]
        return out + _biased(ours + "proj", f"{attn}linear_proj.", WHOLE, not m.disable_bias_linear)
    pos = m.qk_pos_emb_head_dim
    q_rows = InterleavedRope(m.qk_head_dim + pos, pos)  # each head's [nope | RoPE] rows
    if m.q_lora_rank:
        out = _biased(ours + "q_down", f"{attn}linear_q_down_proj.")
        if m.qk_layernorm:  # Transformer Engine fuses it into linear_q_up_proj; the local spec's own module
            out += _norm(m, ours + "q_norm", (f"{attn}linear_q_up_proj.layer_norm_", f"{attn}q_layernorm."), True)
        out += _biased(ours + "q_up", f"{attn}linear_q_up_proj.", q_rows)
    else:
        out = _biased(ours + "q", f"{attn}linear_q_proj.", q_rows)
    out += _biased(ours + "kv_down", f"{attn}linear_kv_down_proj.", InterleavedRope(m.kv_lora_rank + pos, pos))
    if m.qk_layernorm:
        out += _norm(m, ours + "kv_norm", (f"{attn}linear_kv_up_proj.layer_norm_", f"{attn}kv_layernorm."), True)
    return out + _biased(ours + "kv_up", f"{attn}linear_kv_up_proj.") + _biased(ours + "proj", f"{attn}linear_proj.")


def layer_entries(m, ours: str, meg: str, moe: bool) -> list:
    """One transformer layer's tensors: Ternion's under `ours` (`layers.{i}.`), Megatron's under `meg`."""
    attn, mla = f"{meg}self_attention.", m.multi_latent_attention
    # Under MLA both specs keep input_layernorm a module of its own (no norm fused into a q projection).
    norm1 = (f"{meg}input_layernorm.",) if mla else (f"{attn}linear_qkv.layer_norm_", f"{meg}input_layernorm.")
    out = _norm(m, ours + "norm1", norm1) + _attention(m, ours + "attention.", attn)
    norm2 = (f"{meg}pre_mlp_layernorm.", f"{meg}mlp.linear_fc1.layer_norm_") if moe else \
        (f"{meg}mlp.linear_fc1.layer_norm_", f"{meg}pre_mlp_layernorm.")
    out += _norm(m, ours + "norm2", norm2, moe or mla)
    return out + (_moe(m, ours + "mlp", f"{meg}mlp.") if moe else _mlp(m, ours + "mlp", f"{meg}mlp."))


def mtp_entries(m, k: int) -> list:
    """Multi-token prediction module k's tensors (its layer built like the decoder's last: MoE where that is)."""
    ours, meg = f"mtp.{k}.", f"mtp.layers.{k}."
    out = _norm(m, ours + "embedding_norm", (f"{meg}enorm.",)) + _norm(m, ours + "hidden_norm", (f"{meg}hnorm.",))
    out += _biased(ours + "proj", f"{meg}eh_proj.")
    out += layer_entries(m, ours + "layer.", f"{meg}transformer_layer.", m.num_layers + k in m.routed_layers())
    return out + _norm(m, ours + "final_norm", (f"{meg}final_layernorm.",))


def plan(m) -> list:
    """Every Ternion tensor of model `m` with its Megatron names and transform."""
    out = [Entry("word.weight", ("embedding.word_embeddings.weight",), WHOLE)]
    if m.position_embedding_type == "learned_absolute":
        out.append(Entry("position", ("embedding.position_embeddings.weight",), WHOLE))
    moe = set(m.moe_layers()) if m.num_experts else set()
    for i in range(m.num_layers):
        out += layer_entries(m, f"layers.{i}.", f"decoder.layers.{i}.", i in moe)
    for k in range(m.mtp_num_layers or 0):
        out += mtp_entries(m, k)
    out += _norm(m, "final_norm", ("decoder.final_layernorm.",))
    if m.untie_embeddings_and_output_weights:
        out.append(Entry("output", ("output_layer.weight",), WHOLE))
    return out


def homogeneous(m) -> bool:
    """Whether megatron-core stacks the layers' tensors (every layer alike: no mix of dense and MoE layers)."""
    return not m.num_experts or len(m.moe_layers()) == m.num_layers


def split_layer(name: str):
    """`decoder.layers.{i}.<rest>` -> (i, <rest>); another name -> (None, name)."""
    if not name.startswith("decoder.layers."):
        return None, name
    head, _, rest = name[len("decoder.layers."):].partition(".")
    return (int(head), rest) if head.isdigit() else (None, name)


def stored_names(name: str) -> list:
    """Where a per-layer name may be stored: (key, leading indices) in the stacked and the per-layer form."""
    layer, rest = split_layer(name)
    if layer is None:
        return [(name, ())]
    return [(f"decoder.layers.{rest}", (layer,)), (name, ())]


# How megatron-core splits a tensor over tp: along the output rows of the column-parallel linears and the
# vocabulary, along the inputs of the row-parallel ones; the rest (norms, the row-parallel biases, the router) is
# replicated. MLA's down-projections (Transformer Engine's spec duplicates them, the local spec splits their rows)
# and MTP's eh_proj (column-parallel) are written whole: a torch_dist save holds one global tensor however it
# was split, and megatron-core reads its slices of a whole one. (The legacy format, which keeps the slices, is
# not read for MLA or MTP models: legacy.py.)
_ROWS = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
         "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")


def tp_axis(key: str):
    return 0 if key.endswith(_ROWS) else 1 if key.endswith(_COLUMNS) else None


def join_tp(key: str, parts: list, swiglu: bool) -> torch.Tensor:
    """One tensor from its tp slices: SwiGLU's linear_fc1 slices each hold [gate slice; up slice], joined as
    [gate; up]."""
    axis = tp_axis(key)
    if axis is None or len(parts) == 1:
        return parts[0]
    if swiglu and "linear_fc1." in key:
        halves = [x.chunk(2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=axis)

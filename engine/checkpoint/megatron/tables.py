"""Which Megatron-Core tensor each Ternion tensor is, one table for every architecture: GPT (LayerNorm, learned
positions, GELU, biases), Llama-style (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, QK-norm) and
MoE (router, expert bias, routed experts as one grouped tensor, shared expert), each piece where the model has it.

Names are Megatron-Core's sharded keys with the layer number written in: `decoder.layers.{i}.<name>` stands for
layer i of the stacked `decoder.layers.<name>` [num_layers, ...] (or the per-layer key a model with dense and MoE
layers mixed is saved under). Some tensors have two names, the Transformer Engine spec's and the local spec's
(norms fused into the next linear, or a separate module); readers take the one present, the writer writes the
first (and for an MoE layer's pre-MLP norm, both: each spec loads its own and ignores the other).

What was checked against megatron-core 0.16.1 (tests/test_megatron_checkpoint.py): linear_qkv's rows are
Ternion's own group-interleaved order ([g: the group's query heads, its key, its value] per query group: both
split by query groups over tp); SwiGLU's linear_fc1 is [gate; up] over the whole tensor (the sharded form
stores every tp rank's gate before every up), Ternion's [2, F, h] stack; experts are [E, out, in] by global
expert id, Ternion's fc1 [E, h, F1] / fc2 [E, F, h] transposed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.checkpoint.hf.transforms import WHOLE, Transform


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


def _biased(ours: str, names, how=WHOLE, bias: bool = False) -> list:
    """The weight, and the bias where the model has one."""
    names = (names,) if isinstance(names, str) else names
    out = [Entry(f"{ours}.weight", tuple(f"{n}weight" for n in names), how)]
    if bias:
        out.append(Entry(f"{ours}.bias", tuple(f"{n}bias" for n in names), how))
    return out


def _norm(m, ours: str, names: tuple) -> list:
    return [Entry(f"{ours}.{kind}", tuple(f"{n}{kind}" for n in names), WHOLE)
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


def layer_entries(m, i: int, moe: bool) -> list:
    """Layer i's tensors."""
    ours, meg = f"layers.{i}.", f"decoder.layers.{i}."
    attn = f"{meg}self_attention."
    out = _norm(m, ours + "norm1", (f"{attn}linear_qkv.layer_norm_", f"{meg}input_layernorm."))
    out += _biased(ours + "attention.qkv", f"{attn}linear_qkv.", WHOLE,
                   not m.disable_bias_linear or m.add_qkv_bias)
    if m.qk_layernorm:
        out += [e for x in "qk" for e in _norm(m, f"{ours}attention.qk_norm.{x}", (f"{attn}{x}_layernorm.",))]
    out += _biased(ours + "attention.proj", f"{attn}linear_proj.", WHOLE, not m.disable_bias_linear)
    norm2 = (f"{meg}pre_mlp_layernorm.", f"{meg}mlp.linear_fc1.layer_norm_") if moe else \
        (f"{meg}mlp.linear_fc1.layer_norm_", f"{meg}pre_mlp_layernorm.")
    out += _norm(m, ours + "norm2", norm2)
    return out + (_moe(m, ours + "mlp", f"{meg}mlp.") if moe else _mlp(m, ours + "mlp", f"{meg}mlp."))


def plan(m) -> list:
    """Every Ternion tensor of model `m` with its Megatron names and transform."""
    out = [Entry("word.weight", ("embedding.word_embeddings.weight",), WHOLE)]
    if m.position_embedding_type == "learned_absolute":
        out.append(Entry("position", ("embedding.position_embeddings.weight",), WHOLE))
    moe = set(m.moe_layers()) if m.num_experts else set()
    for i in range(m.num_layers):
        out += layer_entries(m, i, i in moe)
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
# replicated.
_ROWS = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
         "output_layer.weight")
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

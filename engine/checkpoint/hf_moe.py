"""Mixture-of-Experts layers in transformers' layouts: which HF family an MoE model is, and its MLP tensors.

engine/checkpoint/hf.py keeps the one mapping table; this module adds the MoE block of a layer to it.
Our MoE block (engine/moe): router `mlp.router.weight` [E, h] (softmax over fp32 logits, top k, weights
renormalised over the k), experts `mlp.experts.fc1` [E, h, 2F] (x @ fc1[e]: columns [:F] the SwiGLU gate,
[F:] the up projection) and `mlp.experts.fc2` [E, F, h], and optionally a shared expert `mlp.shared` (an
ordinary SwiGLU MLP) added with no gate. Both HF families store each expert as Linear weights [out, in]
(transformers 5 fuses them into `experts.gate_up_proj` when it loads and splits them back when it saves,
so the per-expert names below are what save_pretrained writes, the Hub checkpoints' layout):

- MixtralForCausalLM: every layer MoE, no shared expert, no biases. `block_sparse_moe.gate` is the router,
  `block_sparse_moe.experts.{e}.w1 / w3 / w2` expert e's gate / up / down projections. Imported too.
- Qwen2MoeForCausalLM: a shared expert in every MoE layer, dense layers named in `mlp_only_layers`,
  `norm_topk_prob: true`. Its shared expert is scaled by sigmoid(shared_expert_gate(x)); ours has no gate,
  so the export writes a zero gate (sigmoid(0) = 0.5) and the shared down projection times 2: both are
  powers of two, so the HF model computes exactly our numbers. q/k/v biases are always written (zeros
  where our model has none): Qwen2-MoE code before transformers 5's `qkv_bias` always has them. Export
  only: trained Qwen2-MoE models have non-zero gates (and mostly norm_topk_prob false), which Ternion
  cannot express.
- Qwen3MoeForCausalLM is never a fit: it normalises q and k per head (QK-norm), which Ternion lacks.

Anything else (sigmoid scores, an expert bias, capacity dropping, a top-k scaling factor, dense layers
without a shared expert, ...) is refused by `moe_architecture` with one line naming why.
"""
from __future__ import annotations

import torch

from engine.config import ConfigError

MIXTRAL, QWEN2_MOE = "mixtral", "qwen2_moe"
KINDS = ("expert_in", "expert_out", "double", "zero_gate", "zero_bias")  # the `how`s this module applies


def _refuse(why: str) -> ConfigError:
    return ConfigError(f"--format hf: {why}; transformers' Mixtral and Qwen2-MoE cannot express it exactly, use "
                       "--format native")


def moe_architecture(m) -> str:
    """MIXTRAL or QWEN2_MOE for an MoE model that one of them computes exactly; else one ConfigError line."""
    llama = m.normalization == "RMSNorm" and m.position_embedding_type == "rope" and m.swiglu
    if not (llama and m.disable_bias_linear):
        raise _refuse("the MoE model is not Llama-shaped (RMSNorm, rope, SwiGLU experts, --disable-bias-linear)")
    if m.moe_router_score_function != "softmax":
        raise _refuse(f"the router scores with {m.moe_router_score_function} (--moe-router-score-function); "
                      "both HF families use softmax")
    if m.moe_router_enable_expert_bias:
        raise _refuse("the router adds an expert bias to its choice (--moe-router-enable-expert-bias)")
    if m.moe_expert_capacity_factor is not None:
        raise _refuse(f"experts drop tokens over capacity (--moe-expert-capacity-factor "
                      f"{m.moe_expert_capacity_factor}); the HF models are dropless")
    if m.moe_router_topk_scaling_factor not in (None, 1, 1.0):
        raise _refuse(f"the routing weights are scaled by {m.moe_router_topk_scaling_factor} "
                      "(--moe-router-topk-scaling-factor)")
    if m.moe_shared_expert_intermediate_size:
        return QWEN2_MOE
    dense = sorted(set(range(m.num_layers)) - set(m.moe_layers()))
    if dense:
        raise _refuse(f"layers {dense} are dense and there is no shared expert (Mixtral has every layer MoE, "
                      "Qwen2-MoE a shared expert, Qwen3-MoE QK-norm, which Ternion lacks)")
    if m.add_qkv_bias:
        raise _refuse("QKV biases without a shared expert (Mixtral has no biases)")
    return MIXTRAL


def moe_plan(arch: str, m, src: str, dst: str) -> list:
    """(HF name, our name, how) of one MoE layer's MLP block; src/dst: our and HF's prefix of the layer."""
    ours, E = src + "mlp.", m.num_experts
    if arch == MIXTRAL:
        hf = dst + "block_sparse_moe."
        plan = [(hf + "gate.weight", ours + "router.weight", None)]
        names = ("w1", "w3", "w2")
    else:
        hf = dst + "mlp."
        plan = [(hf + "gate.weight", ours + "router.weight", None),
                (hf + "shared_expert_gate.weight", ours + "router.weight", ("zero_gate", None))]
        names = ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        plan.append((f"{hf}experts.{e}.{names[0]}.weight", ours + "experts.fc1", ("expert_in", (e, 0))))
        plan.append((f"{hf}experts.{e}.{names[1]}.weight", ours + "experts.fc1", ("expert_in", (e, 1))))
    for e in range(E):
        plan.append((f"{hf}experts.{e}.{names[2]}.weight", ours + "experts.fc2", ("expert_out", e)))
    if arch == QWEN2_MOE:
        plan += [(hf + "shared_expert.gate_proj.weight", ours + "shared.fc1.weight", ("stack", 0)),
                 (hf + "shared_expert.up_proj.weight", ours + "shared.fc1.weight", ("stack", 1)),
                 (hf + "shared_expert.down_proj.weight", ours + "shared.fc2.weight", ("double", None))]
    return plan


def transform(t: torch.Tensor, how, m) -> torch.Tensor:
    """Our tensor `t` -> the HF tensor `how` names (KINDS)."""
    kind, arg = how
    if kind == "expert_in":  # fc1[e] [h, 2F]: gate (part 0) or up (part 1) as a Linear weight [F, h]
        (e, part), F = arg, m.resolved_moe_ffn_hidden_size()
        return t[e][:, part * F:(part + 1) * F].t()
    if kind == "expert_out":  # fc2[e] [F, h] -> [h, F]
        return t[arg].t()
    if kind == "double":
        return t * 2
    if kind == "zero_gate":  # from the router weight [E, h]: a [1, h] gate of zeros
        return t.new_zeros((1, t.shape[-1]))
    return t.new_zeros(arg)  # zero_bias: a bias of `arg` entries, from the weight it belongs to


def place(full: torch.Tensor, t: torch.Tensor, how, m) -> None:
    """The inverse of `transform`: put the HF tensor `t` where it came from in our tensor `full`."""
    kind, arg = how
    if kind == "expert_in":
        (e, part), F = arg, m.resolved_moe_ffn_hidden_size()
        full[e][:, part * F:(part + 1) * F].copy_(t.t())
    elif kind == "expert_out":
        full[arg].copy_(t.t())
    elif kind == "double":
        full.copy_(t / 2)
    elif t.any():
        raise ConfigError(f"a {'shared expert gate' if kind == 'zero_gate' else 'bias'} is not zero: Ternion has "
                          "no such tensor")

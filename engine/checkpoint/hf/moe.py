"""What every Hugging Face MoE family shares: which MoE models they compute exactly, the expert tensors'
layout, and a Llama plan with an MoE block in the MoE layers.

Our MoE block (engine/moe): router `mlp.router.weight` [E, h] (softmax over fp32 logits, top k, weights
renormalised over the k), experts `mlp.experts.fc1` [E, h, 2F] (x @ fc1[e]: columns [:F] the SwiGLU gate,
[F:] the up projection) and `mlp.experts.fc2` [E, F, h], and optionally a shared expert `mlp.shared` (an
ordinary SwiGLU MLP) added with no gate. The HF families store each expert as Linear weights [out, in]
(transformers 5 fuses them into `experts.gate_up_proj` when it loads and splits them back when it saves,
so the per-expert names are what save_pretrained writes, the Hub checkpoints' layout).

Qwen3MoeForCausalLM has per-head QK-norm (--qk-layernorm) and no shared expert. Anything no family computes
(sigmoid scores, an expert bias, capacity dropping, a top-k scaling factor, dense layers without a shared
expert or QK-norm, ...) is refused by `refusal` with one line naming why.
"""
from __future__ import annotations

from typing import Optional

from engine.checkpoint.hf import llama
from engine.checkpoint.hf.adapter import Rule, same
from engine.checkpoint.hf.transforms import ExpertIn, ExpertOut
from engine.config import ConfigError


# The load-balancing loss every family's config holds: its coefficient is --moe-aux-loss-coeff both ways (transformers
# adds the loss in training only with output_router_logits, written true when the run had one). The loss it weighs
# is Megatron-Core's, per MoE layer and summed over them; transformers' is one over every layer's tokens at once,
# without the 1/topk (docs/from-megatron.md).
AUX_LOSS = (same("router_aux_loss_coef", "moe_aux_loss_coeff"),
            Rule("output_router_logits", lambda m: m.moe_aux_loss_coeff > 0, lambda v: {}))
AUX_LOSS_DEFAULT = {"router_aux_loss_coef": 0.001}  # transformers' where config.json leaves it out


def dense_layers(m) -> list:
    return sorted(set(range(m.num_layers)) - set(m.moe_layers()))


def router_refusal(m) -> Optional[str]:
    """Why no HF MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE) computes this MoE model's layers and router exactly
    (None: each can, given its attention and experts)."""
    llama_shaped = m.normalization == "RMSNorm" and m.position_embedding_type == "rope" and m.swiglu
    if not (llama_shaped and m.disable_bias_linear):
        return "the MoE model is not Llama-shaped (RMSNorm, rope, SwiGLU experts, --disable-bias-linear)"
    if m.moe_router_score_function != "softmax":
        return (f"the router scores with {m.moe_router_score_function} (--moe-router-score-function); "
                "the HF families use softmax")
    if m.moe_router_num_groups:
        return f"the router limits each token to {m.moe_router_group_topk} of {m.moe_router_num_groups} expert groups"
    if m.moe_router_enable_expert_bias:
        return "the router adds an expert bias to its choice (--moe-router-enable-expert-bias)"
    if m.moe_expert_capacity_factor is not None:
        return (f"experts drop tokens over capacity (--moe-expert-capacity-factor {m.moe_expert_capacity_factor}); "
                "the HF models are dropless")
    if m.moe_router_topk_scaling_factor not in (None, 1, 1.0):
        return (f"the routing weights are scaled by {m.moe_router_topk_scaling_factor} "
                "(--moe-router-topk-scaling-factor)")
    return None


def refusal(m) -> ConfigError:
    """The one line saying why no MoE family fits the MoE model `m`."""
    shared, qk = m.moe_shared_expert_intermediate_size, m.qk_layernorm
    whys = ((m.norm_placement != "pre", "the norms follow the sublayers (--norm-placement post; OLMo-2 is dense)"),
            (qk and m.qk_layernorm_scope != "head", "QK-norm over the whole projection (--qk-layernorm-scope "
                                                    "projection; Qwen3-MoE normalises per head)"),
            (qk and bool(shared), "QK-norm with a shared expert (Qwen3-MoE has no shared expert)"),
            (qk, "QKV biases with QK-norm (Qwen3-MoE has none)"),
            (bool(dense_layers(m)), f"layers {dense_layers(m)} are dense and there is no shared expert (Mixtral has "
                                    "every layer MoE, Qwen2-MoE a shared expert, Qwen3-MoE QK-norm: --qk-layernorm)"),
            (True, "QKV biases without a shared expert (Mixtral has no biases)"))
    why = router_refusal(m) or next(text for holds, text in whys if holds)
    return ConfigError(f"--format hf: {why}; transformers' Mixtral, Qwen2-MoE and Qwen3-MoE cannot express it "
                       "exactly, use --format native")


def experts(m, hf: str, ours: str, names: tuple) -> list:
    """Every expert's gate, up and down projections (`names` in that order) under the prefixes hf and ours."""
    width = m.resolved_moe_ffn_hidden_size()
    entries = []
    for e in range(m.num_experts):
        entries.append((f"{hf}{e}.{names[0]}.weight", ours + "fc1", ExpertIn(e, 0, width)))
        entries.append((f"{hf}{e}.{names[1]}.weight", ours + "fc1", ExpertIn(e, 1, width)))
    return entries + [(f"{hf}{e}.{names[2]}.weight", ours + "fc2", ExpertOut(e)) for e in range(m.num_experts)]


def plan(m, block, projections=llama.qkv) -> list:
    """Llama's plan with `block(m, src, dst)` as the MLP of the MoE layers (dense layers keep Llama's MLP)."""
    moe = set(m.moe_layers())

    def layer(i: int, src: str, dst: str) -> list:
        mlp = block(m, src, dst) if i in moe else llama.mlp(m, src, dst)
        return llama.attention(m, src, dst, projections) + mlp
    return llama.plan(m, layer)

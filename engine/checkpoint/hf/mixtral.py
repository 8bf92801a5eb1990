"""MixtralForCausalLM: Llama attention, every layer MoE, no shared expert, no biases. `block_sparse_moe.gate` is
the router, `block_sparse_moe.experts.{e}.w1 / w3 / w2` expert e's gate / up / down projections. Imported too,
with its sliding window (on every layer, where set).
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, moe
from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, same
from engine.checkpoint.hf.transforms import WHOLE

SHAPE = llama.SHAPE | {"disable_bias_linear": True}
RULES = tuple(r for r in llama.RULES if r.key != "intermediate_size") + (
    Rule("intermediate_size", lambda m: m.resolved_moe_ffn_hidden_size(), lambda v: {"ffn_hidden_size": v}),
    same("num_local_experts", "num_experts"), same("num_experts_per_tok", "moe_router_topk"),
    Rule("router_jitter_noise", lambda m: 0.0, lambda v: {}),  # noise on training inputs only: not kept
    llama.every_layer_window("MixtralForCausalLM"), *moe.AUX_LOSS,
)


def block(m, src: str, dst: str) -> list:
    hf, ours = dst + "block_sparse_moe.", src + "mlp."
    return [(hf + "gate.weight", ours + "router.weight", WHOLE)] + moe.experts(m, hf + "experts.", ours + "experts.",
                                                                                ("w1", "w3", "w2"))


def _fits(m) -> bool:
    return (bool(m.num_experts) and not m.moe_shared_expert_intermediate_size and moe.router_refusal(m) is None
            and not moe.dense_layers(m) and has_shape(m, SHAPE))


ADAPTER = Adapter(
    "MixtralForCausalLM", "mixtral", SHAPE, RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6,
     "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336, **moe.AUX_LOSS_DEFAULT},
    lambda m: moe.plan(m, block), _fits,
    imports=("mixtral",), windows=True, prepare=llama.rope_parameters, moe=True)

"""Qwen2MoeForCausalLM, export only: a shared expert in every MoE layer, dense layers named in `mlp_only_layers`,
`norm_topk_prob: true`.

Its shared expert is scaled by sigmoid(shared_expert_gate(x)); ours has no gate, so the export writes a zero
gate (sigmoid(0) = 0.5) and the shared down projection times 2: both are powers of two, so the HF model
computes exactly our numbers. q/k/v biases are always written (zeros where our model has none): Qwen2-MoE
code before transformers 5's `qkv_bias` always has them. Not imported: trained Qwen2-MoE models have non-zero
gates (and mostly norm_topk_prob false), which Ternion cannot express.
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, moe
from engine.checkpoint.hf.adapter import PLAIN_LAYER, Adapter, Rule, has_shape, only, same
from engine.checkpoint.hf.transforms import QKV, WHOLE, Doubled, Part, ZeroBias, ZeroGate

SHAPE = llama.SHAPE | {"disable_bias_linear": True}
RULES = llama.RULES + (  # `into` is never called: the family is not imported
    same("num_experts", "num_experts"), same("num_experts_per_tok", "moe_router_topk"),
    same("moe_intermediate_size", "moe_ffn_hidden_size", lambda m: m.resolved_moe_ffn_hidden_size()),
    same("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
    Rule("mlp_only_layers", moe.dense_layers, lambda v: {}),
    only("norm_topk_prob", True, "top-k routing weights are renormalised"),
    only("decoder_sparse_step", 1, "MoE layers are the ones not in mlp_only_layers"),
    only("qkv_bias", True, "zeros are written where the model has no QKV bias"),
    only("use_sliding_window", False, "attention covers the whole sequence"), *moe.AUX_LOSS,
)


def projections(m, src: str, dst: str) -> list:
    """Llama's q/k/v, and zero biases where the model has none (exact, and what its loaders expect)."""
    entries = llama.qkv(m, src, dst)
    if m.disable_bias_linear and not m.add_qkv_bias:
        for j, proj in enumerate(llama.PROJECTIONS):
            size = len(QKV.of(m, j).rows())
            entries.append((f"{dst}self_attn.{proj}.bias", f"{src}attention.qkv.weight", ZeroBias(size)))
    return entries


def block(m, src: str, dst: str) -> list:
    hf, ours = dst + "mlp.", src + "mlp."
    entries = [(hf + "gate.weight", ours + "router.weight", WHOLE),
               (hf + "shared_expert_gate.weight", ours + "router.weight", ZeroGate())]
    entries += moe.experts(m, hf + "experts.", ours + "experts.", ("gate_proj", "up_proj", "down_proj"))
    return entries + [(hf + "shared_expert.gate_proj.weight", ours + "shared.fc1.weight", Part(0)),
                      (hf + "shared_expert.up_proj.weight", ours + "shared.fc1.weight", Part(1)),
                      (hf + "shared_expert.down_proj.weight", ours + "shared.fc2.weight", Doubled())]


def _fits(m) -> bool:
    return (bool(m.num_experts) and bool(m.moe_shared_expert_intermediate_size) and moe.router_refusal(m) is None
            and has_shape(m, PLAIN_LAYER))


ADAPTER = Adapter("Qwen2MoeForCausalLM", "qwen2_moe", SHAPE, RULES, {},
                  lambda m: moe.plan(m, block, projections), _fits, moe=True)

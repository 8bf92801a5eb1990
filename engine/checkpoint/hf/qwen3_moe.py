"""Qwen3MoeForCausalLM: Qwen3's attention (per-head QK-norm, its own head_dim, no biases) with routed experts
and no shared expert. `mlp.gate` is the router, `mlp.experts.{e}.gate_proj / up_proj / down_proj` expert e's
projections; dense layers (those in `mlp_only_layers`, or skipped by `decoder_sparse_step`) have a SwiGLU MLP of
`intermediate_size`, the experts `moe_intermediate_size`.

Its router is a softmax over all experts followed by the top k; with `norm_topk_prob: true` (Qwen3-30B-A3B's
and Qwen3-235B-A22B's) the k weights are renormalised, which is Ternion's softmax router. Without it they are
not, and Ternion has no such router: refused. save_pretrained writes the expert count as `num_local_experts`,
the Hub's files `num_experts`: both are read. Its sliding window, which `use_sliding_window` turns on, is on
every layer (transformers' Qwen3-MoE reads no layer_types).
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, moe, qwen2, qwen3
from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, only, same
from engine.checkpoint.hf.transforms import WHOLE

SHAPE = qwen3.SHAPE
RULES = qwen3.RULES + (
    same("num_experts", "num_experts"), same("num_experts_per_tok", "moe_router_topk"),
    same("moe_intermediate_size", "moe_ffn_hidden_size", lambda m: m.resolved_moe_ffn_hidden_size()),
    only("norm_topk_prob", True, "Ternion's router renormalises the top-k routing weights"),
    Rule("mlp_only_layers", moe.dense_layers, lambda pattern: {"moe_layer_freq": pattern}),  # see _prepare
    Rule("decoder_sparse_step", lambda m: 1, lambda v: {}),  # read with mlp_only_layers
    qwen2.USE_SLIDING_WINDOW, llama.every_layer_window("Qwen3MoeForCausalLM"), *moe.AUX_LOSS,
)


def _prepare(values: dict) -> dict:
    """config.json as the rules read it: num_local_experts as num_experts, and `mlp_only_layers` with
    `decoder_sparse_step` as Ternion's per-layer MoE pattern (--moe-layer-freq: 1 where every layer is MoE, else
    a 0/1 list; layer i is MoE unless listed or (i + 1) is not a multiple of the step)."""
    values = qwen2.switched(llama.rope_parameters(values))
    if "num_local_experts" in values:
        values = {k: v for k, v in values.items() if k != "num_local_experts"} | {"num_experts":
                                                                                   values["num_local_experts"]}
    step, dense = values.get("decoder_sparse_step") or 1, set(values.get("mlp_only_layers") or ())
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(values.get("num_hidden_layers", 0))]
    return values | {"mlp_only_layers": "1" if all(pattern) else str(pattern).replace(" ", "")}


def block(m, src: str, dst: str) -> list:
    hf, ours = dst + "mlp.", src + "mlp."
    return [(hf + "gate.weight", ours + "router.weight", WHOLE)] + moe.experts(m, hf + "experts.", ours + "experts.",
                                                                                ("gate_proj", "up_proj", "down_proj"))


def _fits(m) -> bool:
    return (bool(m.num_experts) and not m.moe_shared_expert_intermediate_size and moe.router_refusal(m) is None
            and has_shape(m, SHAPE))


ADAPTER = Adapter(
    "Qwen3MoeForCausalLM", "qwen3_moe", SHAPE, RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "attention_bias": False,
     "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
     "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], **moe.AUX_LOSS_DEFAULT},
    lambda m: moe.plan(m, block, qwen3.projections), _fits,
    imports=("qwen3_moe",), windows=True, prepare=_prepare, moe=True)

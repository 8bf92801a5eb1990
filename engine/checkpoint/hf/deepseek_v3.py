"""DeepseekV3ForCausalLM: multi-head latent attention, sigmoid-scored group-limited routing with an expert bias and
a scaling factor, a shared expert in every MoE layer, the first `first_k_dense_replace` layers dense (also
Kimi-K2's and DeepSeek-V3.1's architecture).

Attention (engine/latent_attention.py): `self_attn.q_proj` (no q latent) or `q_a_proj`, `q_a_layernorm`,
`q_b_proj`; `kv_a_proj_with_mqa` (the kv latent's rows, then the RoPE key's), `kv_a_layernorm`, `kv_b_proj`
(each head's key rows, then its value rows), `o_proj`. DeepSeek's checkpoints rotate interleaved pairs (x0, x1),
(x2, x3), ... (`rope_interleave: true`, the default); Ternion rotates the halves (x_i, x_i+d/2), so the RoPE
rows of q and of the shared key are reordered on the way (`InterleavedRope`): the same permutation on both
sides of every dot product, exact. The latent norms are transformers' RMSNorm with eps 1e-6 whatever
`rms_norm_eps` says: models whose --norm-epsilon differs are refused on export. RoPE is YaRN (`rope_type:
yarn`, its factor, original context, beta_fast/slow, mscale, mscale_all_dim) or plain.

MoE layers: `mlp.gate` the router (`weight`, and `e_score_correction_bias`, our expert bias: imported models
get --moe-router-enable-expert-bias, which is how DeepSeek-V3 balances; a model without one exports zeros),
`mlp.experts.{e}.gate_proj / up_proj / down_proj`, `mlp.shared_experts.*` of n_shared_experts x
moe_intermediate_size. transformers builds no multi-token-prediction module and its files hold none: an
imported model gets none (add --mtp-num-layers to train fresh ones); DeepSeek's own files keep theirs as layer
`num_hidden_layers`, which the import leaves out with a note (docs/deepseek-v3.md: limits).
"""
from __future__ import annotations

from engine.checkpoint.hf import llama, moe
from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, only, same
from engine.checkpoint.hf.transforms import WHOLE, InterleavedRope, Part, ZeroBias
from engine.config import ConfigError

SHAPE = llama.SHAPE | {"multi_latent_attention": True, "qk_layernorm": True, "disable_bias_linear": True,
                       "moe_router_score_function": "sigmoid"}
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm
YARN = (("factor", "rotary_scaling_factor"), ("original_max_position_embeddings", "original_max_position_embeddings"),
        ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("mscale", "mscale"),
        ("mscale_all_dim", "mscale_all_dim"))


def _yarn(m) -> bool:
    return m.yarn() and m.rotary_scaling_factor != 1  # YaRN without extension is plain RoPE


def _rope_out(m) -> dict:
    if not _yarn(m):
        return {"rope_type": "default", "rope_theta": m.rotary_base}
    return {"rope_type": "yarn", "rope_theta": m.rotary_base} | {hf: getattr(m, ours) for hf, ours in YARN}


def _rope_into(rope: dict) -> dict:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"config.json rope type {kind!r}: Ternion's MLA has plain and YaRN ('yarn') RoPE only")
    fields = {"rotary_base": float(rope.get("rope_theta", 10000.0)), "rope_type": "yarn"}
    if kind == "yarn":
        fields |= {ours: rope[hf] for hf, ours in YARN if rope.get(hf) is not None}
    return fields


def _dense_count(m) -> int:
    return len(moe.dense_layers(m))


def _shared_experts(m) -> int:
    return m.moe_shared_expert_intermediate_size // m.resolved_moe_ffn_hidden_size()


def _groups_out(m):
    return m.moe_router_num_groups or 1


_KEPT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "max_position_embeddings", "rms_norm_eps", "attention_dropout", "initializer_range", "hidden_act",
         "tie_word_embeddings")
RULES = tuple(r for r in llama.RULES if r.key in _KEPT) + (
    Rule("num_key_value_heads", lambda m: m.num_attention_heads, lambda v: {}),  # checked in _prepare
    same("q_lora_rank", "q_lora_rank"), same("kv_lora_rank", "kv_lora_rank"),
    same("qk_nope_head_dim", "qk_head_dim"), same("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    same("v_head_dim", "v_head_dim"),
    only("attention_bias", False, "MLA's projections have no biases"),
    only("rope_interleave", True, "the interleaved RoPE rows of DeepSeek's checkpoints are reordered on the way"),
    Rule("rope_theta", lambda m: m.rotary_base, lambda v: {}),  # read through rope_parameters
    Rule("rope_scaling", lambda m: _rope_out(m) if _yarn(m) else None, lambda v: {}),
    Rule("rope_parameters", _rope_out, _rope_into),
    Rule("n_routed_experts", lambda m: m.num_experts,
         lambda v: {"num_experts": v, "moe_router_enable_expert_bias": True}),
    same("num_experts_per_tok", "moe_router_topk"),
    same("moe_intermediate_size", "moe_ffn_hidden_size", lambda m: m.resolved_moe_ffn_hidden_size()),
    Rule("n_shared_experts", _shared_experts,  # read as the width: see _prepare
         lambda width: {"moe_shared_expert_intermediate_size": width}),
    Rule("first_k_dense_replace", _dense_count, lambda pattern: {"moe_layer_freq": pattern}),  # see _prepare
    Rule("n_group", _groups_out, lambda v: {"moe_router_num_groups": v if v > 1 else None}),
    Rule("topk_group", lambda m: m.moe_router_group_topk or 1,
         lambda v: {"moe_router_group_topk": v}),  # None with one group: see _prepare
    Rule("routed_scaling_factor", lambda m: m.moe_router_topk_scaling_factor or 1.0,
         lambda v: {"moe_router_topk_scaling_factor": None if v == 1 else v}),
    only("norm_topk_prob", True, "the sigmoid router renormalises the top-k weights"),
    Rule("num_nextn_predict_layers", lambda m: 0, lambda v: {}),
)


def _prepare(values: dict) -> dict:
    """config.json as the rules read it: RoPE as rope_parameters, the dense layers as a 0/1 list (Ternion's
    --moe-layer-freq), n_shared_experts as the shared expert's width, topk_group of one group as none."""
    values = llama.rope_parameters(values)
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise ConfigError(f"config.json num_key_value_heads {kv_heads}: MLA gives each of the {heads} heads its own "
                          "key and value; Ternion reads no other count")
    layers, k = values.get("num_hidden_layers", 0), values.get("first_k_dense_replace") or 0
    if k >= layers:
        raise ConfigError(f"config.json first_k_dense_replace {k}: no MoE layer among the {layers}; Ternion imports "
                          "DeepSeek-V3 models with at least one")
    shared = (values.get("n_shared_experts") or 0) * values.get("moe_intermediate_size", 0)
    values = values | {"first_k_dense_replace": f"[0]*{k}+[1]*{layers - k}" if k else "1",
                       "n_shared_experts": shared or None}
    return values | ({"topk_group": None} if (values.get("n_group") or 1) == 1 else {})


def attention(m, src: str, dst: str) -> list:
    hf, ours, pos = dst + "self_attn.", src + "attention.", m.qk_pos_emb_head_dim
    q_rows = InterleavedRope(m.qk_head_dim + pos, pos)
    if m.q_lora_rank:
        entries = [(hf + "q_a_proj.weight", ours + "q_down.weight", WHOLE),
                   (hf + "q_a_layernorm.weight", ours + "q_norm.weight", WHOLE),
                   (hf + "q_b_proj.weight", ours + "q_up.weight", q_rows)]
    else:
        entries = [(hf + "q_proj.weight", ours + "q.weight", q_rows)]
    entries += [(hf + "kv_a_proj_with_mqa.weight", ours + "kv_down.weight", InterleavedRope(m.kv_lora_rank + pos,
                                                                                             pos)),
                (hf + "kv_a_layernorm.weight", ours + "kv_norm.weight", WHOLE),
                (hf + "kv_b_proj.weight", ours + "kv_up.weight", WHOLE),
                (hf + "o_proj.weight", ours + "proj.weight", WHOLE)]
    return ([(dst + "input_layernorm.weight", src + "norm1.weight", WHOLE)] + entries
            + [(dst + "post_attention_layernorm.weight", src + "norm2.weight", WHOLE)])


def block(m, src: str, dst: str) -> list:
    hf, ours = dst + "mlp.", src + "mlp."
    bias = (ours + "router.expert_bias", WHOLE) if m.moe_router_enable_expert_bias else \
        (ours + "router.weight", ZeroBias(m.num_experts))
    entries = [(hf + "gate.weight", ours + "router.weight", WHOLE), (hf + "gate.e_score_correction_bias", *bias)]
    entries += moe.experts(m, hf + "experts.", ours + "experts.", ("gate_proj", "up_proj", "down_proj"))
    return entries + [(hf + "shared_experts.gate_proj.weight", ours + "shared.fc1.weight", Part(0)),
                      (hf + "shared_experts.up_proj.weight", ours + "shared.fc1.weight", Part(1)),
                      (hf + "shared_experts.down_proj.weight", ours + "shared.fc2.weight", WHOLE)]


def plan(m) -> list:
    moe_layers = set(m.moe_layers())

    def layer(i: int, src: str, dst: str) -> list:
        return attention(m, src, dst) + (block(m, src, dst) if i in moe_layers else llama.mlp(m, src, dst))
    return llama.plan(m, layer)


def refusal(m):
    """Why transformers' DeepSeek-V3 does not compute the MLA model `m` exactly (None: it does)."""
    dense = moe.dense_layers(m)
    whys = ((not m.num_experts, "the model has no experts (--num-experts)"),
            (m.moe_router_score_function != "sigmoid", "the router scores with softmax (DeepSeek-V3: sigmoid)"),
            (m.moe_router_topk < 2, "one expert per token: DeepSeek-V3 renormalises its weight to 1"),
            (m.moe_expert_capacity_factor is not None, "experts drop tokens over capacity"),
            (not m.moe_shared_expert_intermediate_size or m.moe_shared_expert_intermediate_size
             % m.resolved_moe_ffn_hidden_size(), "the shared expert is not a multiple of --moe-ffn-hidden-size wide"),
            (dense != list(range(len(dense))), f"dense layers {dense} are not the first ones"),
            (not m.qk_layernorm, "the latents have no norms (add --qk-layernorm)"),
            (m.norm_epsilon != LATENT_NORM_EPS, f"--norm-epsilon {m.norm_epsilon}: transformers' latent norms use "
                                                f"{LATENT_NORM_EPS}"),
            (m.mtp_num_layers, "transformers' DeepseekV3ForCausalLM has no multi-token prediction module"),
            (not has_shape(m, SHAPE), "the model is not DeepSeek-V3-shaped (RMSNorm, rope, SwiGLU, no biases)"))
    return next((text for holds, text in whys if holds), None)


ADAPTER = Adapter(
    "DeepseekV3ForCausalLM", "deepseek_v3", SHAPE, RULES,
    {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "attention_bias": False,
     "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "intermediate_size": 18432,
     "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
     "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
     "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_interleave": True, "hidden_act": "silu",
     "num_key_value_heads": None},  # not q_lora_rank: null there means no q latent, and files always write it
    plan, lambda m: m.multi_latent_attention and refusal(m) is None,
    imports=("deepseek_v3", "kimi_k2"), prepare=_prepare, moe=True,
    left_out=lambda m: ((f"model.layers.{m.num_layers}.", "DeepSeek's own multi-token prediction module, which the "
                         "import does not carry; add --mtp-num-layers to train fresh ones"),))

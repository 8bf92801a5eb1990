"""What a microbatch keeps for backward, per layer on one GPU, and how many microbatch-chunks a pipeline rank
holds at its peak: the activation half of the planner's memory model (engine/planner/memory.py adds it up).

Activations per layer are Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4, Table 2), written out tensor by tensor so that grouped-query attention
and SwiGLU are covered. For a GPT-3-shaped layer (MHA, GELU MLP of 4h, 2-byte activations) it gives
exactly the paper's entries:

    no parallelism               s·b·h·(34 + 5·a·s/h)
    tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel   s·b·h/t·(34 + 5·a·s/h)
    tp + selective recompute     s·b·h·(10 + 24/t)
    tp + sp + selective          s·b·h/t·34
    full recompute               2·s·b·h (and /t with sp)

With flash attention the 5·a·s²·b score term is never stored (only the output is), so it is dropped
whatever the recomputation. Dropout masks are counted only where the model has dropout, as the engine
stores them: the two residual masks (2·s·b·h) when hidden_dropout > 0, the attention-probability mask and
dropout output (3·a·s²·b of the 5) when attention_dropout > 0 (Megatron's GPT-3 runs had both at 0.1).

Pipeline schedules (Layout.schedule, engine.pipeline.schedules): the microbatch-chunks a rank
holds at its peak come from the schedule's own order. Under a zero-bubble schedule a chunk's B frees
what backward saved except what its deferred W needs (engine.parallel.mappings: every linear's input and
its output gradient, `w_store_bytes`): the peak is the largest of A x activations + W x stores over the
order, with A chunks between F and B and W between B and W (`zb_in_flight`).
"""
from __future__ import annotations

import functools

from engine.planner.counts import mean_keys_per_query
from engine.config import ModelConfig
from engine.flops import UNIT, Costs
from engine.layout import Layout, PipelineSchedule
from engine.pipeline.schedules import peak_in_flight, schedule_order


def layer_activation_bytes(model: ModelConfig, seq_length: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           flash_attention: bool = False, cp: int = 1, moe: bool = False) -> float:
    """Activation bytes one layer keeps for backward, for one microbatch on one tp rank.

    Under context parallelism a rank holds seq_length/cp tokens of each sequence and saves only its own
    Q, K, V (the ring re-sends the other ranks' K/V in backward), so every term is divided by cp.
    An MoE layer (`moe`) replaces the MLP term with `moe_mlp_activation_bytes`."""
    s, b, h = seq_length // cp, micro_batch, model.hidden_size  # (MLA: `_latents` and its projections' outputs)
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return 2 * s * b * h / sp
    nq = model.num_attention_heads
    ffn = model.resolved_ffn_hidden_size()
    # Not split by tp (split by sp): two norm inputs (4), QKV input (2), MLP input (2), and with residual
    # dropout its two 1-byte masks (2).
    replicated = (8 + 2 * (model.hidden_dropout > 0)) * s * b * h
    # Split by tp: Q and K for the scores, V, the attention output (projection input), the MLP
    # hidden activations (GELU: fc1 output and GELU output; SwiGLU: gate+up output and their product).
    mlp = (6 if model.swiglu else 4) * ffn * s * b if not moe else 0
    if model.multi_latent_attention:
        replicated += _latents(model) * s * b
        qk, v = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
        split = 2 * s * b * nq * (2 * qk + max(qk, v) + v) + mlp  # the values padded to q/k's channels
    else:
        d, nkv = model.head_dim(), model.resolved_query_groups()
        split = 2 * s * b * (nq * d + nkv * d) + 2 * s * b * nkv * d + 2 * s * b * nq * d + mlp
        if model.qk_layernorm:  # QK-norm's inputs (its outputs are the Q and K above); its 1/rms not counted
            split += 2 * s * b * (nq * d + nkv * d)
    # Softmax output (2) per score, and with attention dropout its mask (1) and the dropout output (2).
    per_score = 2 + 3 * (model.attention_dropout > 0)
    keys = mean_keys_per_query(model, s * cp)  # each local query against the whole sequence (or window)
    scores = 0 if (flash_attention or recompute == "selective") else per_score * nq * s * keys * b
    routed = moe_mlp_activation_bytes(model, s * b, tp, sp) if moe else 0.0
    return replicated / sp + (split + scores) / tp + routed


def _latents(model: ModelConfig) -> int:
    """Bytes per token MLA's latents keep, split by sp like the hidden states: the q latent's norm input and the
    up-projection's input (its norm output), the kv down-projection's output (the norm's input, with the RoPE
    key's channels) and the kv up-projection's input."""
    norms = 2 if model.qk_layernorm else 1
    return 2 * (norms * (model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_pos_emb_head_dim
                + (norms - 1) * model.kv_lora_rank)


def moe_mlp_activation_bytes(model: ModelConfig, tokens: float, tp: int = 1, sp: int = 1) -> float:
    """What an MoE block saves for backward beyond its (norm output) input, for a microbatch of `tokens`
    (s·b, this cp rank's share) on one tp rank, 2-byte activations. A rank routes tokens/sp of them (under
    sequence parallelism, sp = tp, each tp rank routes its own); for each of them:
    per routed copy (top-k per token) the gathered expert input (h), the fc1 output (2F with SwiGLU, else F),
    the activation output (F) and the expert output kept for the combine weights' gradient (h); the router's
    fp32 copy of the input (4h) and fp32 logits and scores (8E) per token. The shared expert saves what a
    tensor-parallel MLP of its width does (all tokens, its hidden activations split over tp)."""
    h, f, k, E = model.hidden_size, model.resolved_moe_ffn_hidden_size(), model.moe_router_topk, model.num_experts
    hidden = 6 if model.swiglu else 4
    routed = k * tokens / sp * (4 * h + hidden * f)
    router = tokens / sp * (4 * h + 8 * E)
    shared = hidden * (model.moe_shared_expert_intermediate_size or 0) * tokens / tp
    return routed + router + shared


def w_store_bytes(model: ModelConfig, seq_length: int, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                  cp: int = 1) -> float:
    """What a dense layer keeps for its deferred W pass after its B (zero-bubble schedules;
    engine.parallel.mappings `_defer`): each linear's input (its sequence shard under SP) and its 2-byte output
    gradient. QKV: input h/sp, gradient (nq + 2 nkv)·d/tp; projection: nq·d/tp and h (the row-parallel output's
    gradient is whole on every tp rank); fc1: h/sp and its 1 or 2 x ffn/tp outputs; fc2: ffn/tp and h."""
    tokens = seq_length // cp * micro_batch
    h, d = model.hidden_size, model.head_dim()
    nq, nkv, ffn = model.num_attention_heads, model.resolved_query_groups(), model.resolved_ffn_hidden_size()
    sp = tp if sequence_parallel else 1
    inputs = 2 * h / sp + nq * d / tp + ffn / tp
    grads = ((nq + 2 * nkv) * d + (2 if model.swiglu else 1) * ffn) / tp + 2 * h
    return 2 * tokens * (inputs + grads)


def in_flight_bytes(layout: Layout, rank: int, num_microbatches: int, per_chunk: float, store_chunk: float,
                    costs: Costs = UNIT) -> float:
    """Activation bytes rank `rank` holds at its peak: the schedule's in-flight chunk count x per_chunk; for a
    zero-bubble schedule the largest A·per_chunk + W·store_chunk over its order for these `costs` (A chunks
    between F and B, W between B and W)."""
    if not layout.schedule.split_backward:
        return peak_in_flight(layout.schedule, rank, num_microbatches) * per_chunk
    return max(a * per_chunk + w * store_chunk for a, w in zb_in_flight(layout.schedule, rank, num_microbatches,
                                                                          costs))


@functools.lru_cache(maxsize=4096)
def zb_in_flight(schedule: PipelineSchedule, rank: int, num_microbatches: int, costs: Costs = UNIT) -> tuple:
    """The (A, W) pairs a zero-bubble order (the one built for `costs`) reaches that no other pair dominates: A
    chunk-microbatches with F done and B not, W with B done and W not. The order is replayed for at most 3 pp
    microbatches: past the warm-up its counts repeat (the schedule caps them: engine.pipeline.zero_bubble)."""
    a = w = 0
    seen = set()
    for kind, _, _ in schedule_order(schedule, rank, min(num_microbatches, 3 * schedule.pp), costs):
        a, w = a + (kind == "F") - (kind == "B"), w + (kind == "B") - (kind == "W")
        seen.add((a, w))
    return tuple(sorted(p for p in seen if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in seen)))

"""Data-parallel sharding strategies: the engine's exact weight, gradient and optimizer bytes per rank, and the
bytes each strategy sends per step.

Exact bytes: engine/optim/grad_buffer.py is replayed on the parameter list a rank builds (engine/model.py's
order: per chunk the embedding and learned positions, every layer's norm1, QKV, projection, norm2 and MLP or
MoE block, the final norm and the output layer). The buffer walks each chunk's trainable parameters in reverse,
cuts a bucket once it holds DEFAULT_BUCKET_NUMEL elements, at the end of every chunk (a bucket never spans two
chunks), around the tied embedding (a bucket of its own when pp > 1) and, under optim_grads_params, at every
layer (a gathered unit); MoE experts fill a buffer of their own. When sharded, each bucket is padded to a
multiple of SHARD_ALIGN x n elements (n the dp x cp ranks, dp/ep x cp for experts) and replica k owns its k-th
1/n: data-parallel rank 0 owns min(used, size/n) elements of each bucket, the most of any rank.

    gradients   no_shard, optim: the whole padded buffer in fp32; optim_grads(_params): its 1/n, plus the
                staging of the largest bucket (one full-size fp32 bucket in flight)
    optimizer   fp32 Adam m and v, and the fp32 master (not in fp32 no_shard), over the owned elements
    weights     every parameter in the training dtype; optim_grads_params: the padded 1/n of the buffer plus
                the largest gathered unit (a layer, or the embedding / output layer) on the rank

Communication per step, bytes one rank sends (ring collectives: an all-gather or a reduce-scatter of B bytes
sends (n-1)/n x B, an all-reduce 2(n-1)/n x B; G the gradients' bytes, W the weights' in the training dtype,
m microbatches): no_shard all-reduces G once; optim reduce-scatters G and all-gathers W once; optim_grads
reduce-scatters G every microbatch (no full gradient is kept) and all-gathers W once; optim_grads_params
all-gathers W twice per microbatch (forward and backward) and reduce-scatters G per microbatch, with no
gather after the step (the updated shards are what is stored).
"""
from __future__ import annotations

from typing import Optional

from engine.config import ModelConfig
from engine.optim.grad_buffer import DEFAULT_BUCKET_NUMEL, SHARD_ALIGN
from engine.planner.memory import ADAM_MOMENT_BYTES as MOMENTS
from engine.planner.memory import (
    GRAD_BYTES,
    MASTER_BYTES,
    PARAM_BYTES,
    Layout,
    end_ranks,
    layer_params,
    moe_layer_params,
    param_split_per_rank,
    stage_layer_ids,
)

SHARDED_GRADS = ("optim_grads", "optim_grads_params")


def _model_key(model: ModelConfig, tp: int, ep: int) -> tuple:
    """Everything parameter shapes depend on (ModelConfig itself is not hashable)."""
    return (model.hidden_size, model.num_attention_heads, model.resolved_query_groups(), model.head_dim(),
            model.resolved_ffn_hidden_size(), model.swiglu, model.disable_bias_linear, model.add_qkv_bias,
            model.normalization, model.padded_vocab_size(tp), model.position_embedding_type,
            model.max_position_embeddings or model.seq_length, model.untie_embeddings_and_output_weights,
            model.num_experts, model.num_experts and model.resolved_moe_ffn_hidden_size(),
            model.moe_shared_expert_intermediate_size, model.moe_router_topk, tp, ep)


def _linear(rows: int, cols: int, bias: bool, tp: int, split_rows: bool) -> list:
    """A column-parallel (rows split) or row-parallel (cols split, bias whole) linear: weight, bias."""
    out = [rows * cols // tp]
    if bias:
        out.append(rows // tp if split_rows else rows)
    return out


def _mlp(model: ModelConfig, ffn: int, tp: int) -> list:
    bias, h = not model.disable_bias_linear, model.hidden_size
    return _linear((2 if model.swiglu else 1) * ffn, h, bias, tp, True) + _linear(h, ffn, bias, tp, False)


def layer_param_sizes(model: ModelConfig, tp: int, ep: int, moe: bool) -> tuple:
    """(numel, expert) of one layer's trainable parameters in engine/model.py's order."""
    h, d = model.hidden_size, model.head_dim()
    nq, nkv, bias = model.num_attention_heads, model.resolved_query_groups(), not model.disable_bias_linear
    norm = [h] * (2 if model.normalization == "LayerNorm" else 1)
    attention = norm + _linear((nq + 2 * nkv) * d, h, bias or model.add_qkv_bias, tp, True) + \
        _linear(h, nq * d, bias, tp, False) + norm
    out = [(n, False) for n in attention]
    if not moe:
        return tuple(out + [(n, False) for n in _mlp(model, model.resolved_ffn_hidden_size(), tp)])
    E, f = model.num_experts, model.resolved_moe_ffn_hidden_size()
    out += [(E * h, False), (E // ep * h * (2 if model.swiglu else 1) * f, True), (E // ep * f * h, True)]
    shared = model.moe_shared_expert_intermediate_size
    return tuple(out + ([(n, False) for n in _mlp(model, shared, tp)] if shared else []))


_BUCKETS: dict = {}


def _chunk_buckets(key: tuple, model: ModelConfig, *args) -> tuple:
    """Cached `_fill` (ModelConfig is not hashable: `key` stands for it)."""
    if (key, args) not in _BUCKETS:
        if len(_BUCKETS) > 65536:
            _BUCKETS.clear()
        _BUCKETS[key, args] = _fill(model, key[-2], key[-1], *args)
    return _BUCKETS[key, args]


def _fill(model: ModelConfig, tp: int, ep: int, kinds: tuple, pre: bool, post: bool, pp: int, experts: bool,
          bucket_numel: int, pad: int, by_layer: bool) -> tuple:
    """(used, padded) elements of each bucket one chunk's parameters fill (grad_buffer.GradBuffer._layout).
    `kinds`: the chunk's layers, True for an MoE layer."""
    h, vocab = model.hidden_size, model.padded_vocab_size(tp)
    tied = not model.untie_embeddings_and_output_weights and pp > 1
    params = []  # (numel, tied, unit) in the model's order, this buffer's parameters only
    if pre and not experts:
        params.append((vocab * h // tp, tied, "embedding"))
        if model.position_embedding_type == "learned_absolute":
            params.append(((model.max_position_embeddings or model.seq_length) * h, False, "embedding"))
    for i, moe in enumerate(kinds):
        params += [(n, False, i) for n, e in layer_param_sizes(model, tp, ep, moe) if e == experts]
    if post and not experts:
        params += [(h, False, "head")] * (2 if model.normalization == "LayerNorm" else 1)
        if model.untie_embeddings_and_output_weights or not pre:
            params.append((vocab * h // tp, tied, "head"))
    buckets, used, unit = [], 0, None
    for numel, alone, u in reversed(params):
        if used and (alone or (by_layer and u != unit)):
            buckets.append(used)
            used = 0
        used, unit = used + numel, u
        if alone or (used >= bucket_numel and not by_layer):
            buckets.append(used)
            used = 0
    if used:
        buckets.append(used)
    return tuple((b, -(-b // pad) * pad) for b in buckets)


def rank_buckets(model: ModelConfig, layout: Layout, rank: int, experts: bool = False,
                 bucket_numel: Optional[int] = None) -> list:
    """(used, padded) elements of every bucket of pipeline rank `rank`'s dense (or expert) grad buffer."""
    moe = set(model.moe_layers()) if model.num_experts else set()
    sharded = layout.strategy != "no_shard"
    n = (layout.expert_shard_group if experts else layout.shard_group) if sharded else 1
    pad = SHARD_ALIGN * n if sharded else 1
    key = _model_key(model, layout.tp, layout.ep)
    first, last = end_ranks(layout)
    chunks = stage_layer_ids(model.num_layers, layout)[rank]
    out = []
    for c in reversed(range(len(chunks))):
        pre = rank == first and c == 0
        post = rank == last and c == len(chunks) - 1
        out += _chunk_buckets(key, model, tuple(i in moe for i in chunks[c]), pre, post, layout.pp, experts,
                              bucket_numel or DEFAULT_BUCKET_NUMEL, pad, layout.strategy == "optim_grads_params")
    return out


def _gathered_unit(model: ModelConfig, layout: Layout, rank: int) -> int:
    """Elements of the largest unit optim_grads_params gathers on this rank: a layer, or the embedding or
    output layer on the ranks holding them (engine/planner/memory.py's counts)."""
    tp, ep = layout.tp, layout.ep
    ids = [i for chunk in stage_layer_ids(model.num_layers, layout)[rank] for i in chunk]
    moe = set(model.moe_layers()) if model.num_experts else set()
    dense_layer = layer_params(model, tp)
    moe_layer = sum(moe_layer_params(model, tp, ep)[:2]) if moe else 0
    unit = max([moe_layer if i in moe else dense_layer for i in ids] or [0])
    ends = end_ranks(layout)
    if rank in ends:
        unit = max(unit, model.padded_vocab_size(tp) * model.hidden_size // tp)
    return unit


def rank_state_bytes(model: ModelConfig, layout: Layout, precision: str, rank: int,
                     bucket_numel: Optional[int] = None, split: Optional[tuple] = None) -> tuple:
    """(weights, gradients, optimizer state) bytes data-parallel rank 0 of pipeline rank `rank` allocates;
    `split`: the rank's param_split_per_rank entry, when the caller has it."""
    strategy = layout.strategy
    weights = grads = optimizer = 0
    master = MASTER_BYTES if (precision != "fp32" or strategy != "no_shard") else 0
    dense, experts, frozen = split or param_split_per_rank(model, layout)[rank]
    staging = 0
    for is_expert, n in ((False, layout.shard_group), (True, layout.expert_shard_group)):
        if is_expert and not experts:
            continue
        buckets = rank_buckets(model, layout, rank, is_expert, bucket_numel)
        total = sum(p for _, p in buckets)
        if strategy == "no_shard":
            grads += total * GRAD_BYTES
            optimizer += total * (MOMENTS + master)
            continue
        owned = sum(min(u, p // n) for u, p in buckets)
        optimizer += owned * (MOMENTS + master)
        grads += (total // n if strategy in SHARDED_GRADS else total) * GRAD_BYTES
        staging = max([staging] + [p for _, p in buckets]) if strategy in SHARDED_GRADS else 0
        if strategy == "optim_grads_params":
            weights += total // n * PARAM_BYTES[precision]
    grads += staging * GRAD_BYTES
    if strategy == "optim_grads_params":
        weights += _gathered_unit(model, layout, rank) * PARAM_BYTES[precision]
    else:
        weights = (dense + experts) * PARAM_BYTES[precision]
    return weights + 4 * frozen, grads, optimizer


def dp_bytes_per_step(params: float, layout: Layout, precision: str, num_microbatches: int,
                      grad_bytes: int = GRAD_BYTES, n: Optional[int] = None) -> dict:
    """Bytes one rank sends per step over its n replicas (dp x cp) for `params` parameters: gradient reduction
    and weight gathering, ring volumes (see the module doc)."""
    n = n or layout.shard_group
    if n == 1:
        return dict(grad_reduce=0.0, param_gather=0.0)
    ring = (n - 1) / n
    g, w, m = grad_bytes * params, PARAM_BYTES[precision] * params, num_microbatches
    strategy = layout.strategy
    if strategy == "no_shard":
        return dict(grad_reduce=2 * ring * g, param_gather=0.0)
    if strategy == "optim":
        return dict(grad_reduce=ring * g, param_gather=ring * w)
    if strategy == "optim_grads":
        return dict(grad_reduce=m * ring * g, param_gather=ring * w)
    return dict(grad_reduce=m * ring * g, param_gather=2 * m * ring * w)

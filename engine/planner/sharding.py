"""Data-parallel sharding strategies: the engine's exact weight, gradient and optimizer bytes per rank, the
transient full-size buffers each strategy adds, and the bytes each strategy sends per step.

Exact bytes: engine/optim/grad_buffer.py is replayed on the parameter list a rank builds, in the order forward
first uses them (engine.optim.param_shard.forward_order): per chunk the word embedding, the learned positions,
every layer's norm1, QKV, projection, norm2 and MLP or MoE block, the final norm, and the output layer when it
is not the tied embedding (engine/planner/params.py's inventory). The buffer walks each chunk's trainable
parameters in reverse and, by the rule both share (engine.optim.buckets.cut_buckets), cuts a bucket once it
holds bucket_numel elements, at the end of every chunk (a bucket never spans two chunks),
around the tied embedding (a bucket of its own when pp > 1) and, under optim_grads_params, wherever the gathered
unit changes, ignoring bucket_numel (param_shard.py's units: the embedding = word and position embeddings, each
layer, the head = final norm and output weight, the tied word embedding at pp 1 counting as the head's);
MoE experts fill a buffer of their own. When sharded, each bucket is padded to a multiple of SHARD_ALIGN x n
elements (n the dp x cp ranks, dp/ep x cp for experts) and replica k owns its k-th 1/n: data-parallel rank 0
owns min(used, size/n) elements of each bucket, the most of any rank. Kept between steps
(Optimizer.memory_bytes(), `rank_state_bytes`):

    gradients   no_shard, optim: the whole padded buffer in fp32; optim_grads(_params): its 1/n
    optimizer   fp32 Adam m and v (--optimizer muon: one fp32 momentum for the weights it takes), and the fp32
                master (not in fp32 no_shard), over the owned elements
    weights     every parameter in the training dtype; optim_grads_params: the padded 1/n of the buffer
                (plus, in every strategy, the fp32 MoE expert bias, which no optimizer holds)

Transients (`rank_transient_bytes`), full-size buffers on top of that:

    staging     optim_grads(_params): fp32 gradients of the buckets whose microbatch round is open (see
                `_chunk_staging` for the bound and how it follows from grad_buffer.py)
    gathered    optim_grads_params: the largest unit's buckets in the training dtype (param_shard.py gathers
                one unit at a time), the largest two neighbouring units' with --overlap-param-gather (the next
                unit prefetched); optim, optim_grads: the all-gather target of the step's publish
                (Optimizer._gather_buffer), as large as the largest bucket with other replicas (without,
                the masters go straight into the weights), kept once allocated; with
                --overlap-param-gather none (param_gather.py gathers into the weights, made views of flat
                buckets), only those buckets' padding

Communication per step, bytes one rank sends (ring collectives: an all-gather or a reduce-scatter of B bytes
sends (n-1)/n x B, an all-reduce 2(n-1)/n x B; G the gradients' bytes, W the weights' in the training dtype,
m microbatches): no_shard all-reduces G once; optim reduce-scatters G and all-gathers W once; optim_grads
reduce-scatters G every microbatch (no full gradient is kept) and all-gathers W once; optim_grads_params
all-gathers W twice per microbatch (forward and backward) and reduce-scatters G per microbatch, with no
gather after the step (the updated shards are what is stored). With --fp8-param-gather W is what one gather
produces by engine/planner/fp8_gather.py (the FP8 linears' and routed experts' weights one byte an element;
under ZeRO-3 one pass of unit gathers, the tied embedding's bucket with each of its two units at pp 1).
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

from engine.config import ModelConfig
from engine.layout import Layout
from engine.optim.buckets import cut_buckets
from engine.optim.grad_buffer import DEFAULT_BUCKET_NUMEL, SHARD_ALIGN
from engine.planner.params import ADAM_MOMENT_BYTES as MOMENTS
from engine.planner.params import (GRAD_BYTES, MASTER_BYTES, MUON_MOMENTUM_BYTES, MUON_TAGS, PARAM_BYTES, chunk_tensors,
                                   param_split_per_rank)
from engine.planner.stages import end_ranks, stage_layer_ids


def _model_key(model: ModelConfig, tp: int, ep: int) -> tuple:
    """Everything parameter shapes depend on (ModelConfig itself is not hashable)."""
    return (model.hidden_size, model.num_attention_heads, model.resolved_query_groups(), model.head_dim(),
            model.resolved_ffn_hidden_size(), model.swiglu, model.disable_bias_linear, model.add_qkv_bias,
            model.normalization, model.padded_vocab_size(tp), model.position_embedding_type,
            model.max_position_embeddings or model.seq_length, model.untie_embeddings_and_output_weights,
            model.num_experts, model.num_experts and model.resolved_moe_ffn_hidden_size(),
            model.moe_shared_expert_intermediate_size, model.moe_router_topk, tp, ep)


class ChunkLayout(NamedTuple):
    """One model chunk's part of a grad buffer (dense or expert), as grad_buffer.GradBuffer._layout cuts it."""
    buckets: tuple   # (used, padded) elements of each bucket, in the buffer's order
    arrival: tuple   # the bucket of each parameter, in the order backward produces their gradients
    units: dict      # gathered unit (param_shard.param_units) -> indices of the buckets holding its parameters
    order: tuple     # the chunk's units in forward order
    muon: tuple = ()  # per bucket, the (start, end) of the weights Muon would take (params.MUON_TAGS) in it
    fp8: tuple = ()   # per bucket, the (start, end) of the FP8 weights (params.Tensor.fp8) in it


_BUCKETS: dict = {}


def _chunk_layout(key: tuple, model: ModelConfig, *args) -> ChunkLayout:
    """Cached `_fill` (ModelConfig is not hashable: `key` stands for it)."""
    if (key, args) not in _BUCKETS:
        if len(_BUCKETS) > 65536:
            _BUCKETS.clear()
        _BUCKETS[key, args] = _fill(model, key[-2], key[-1], *args)
    return _BUCKETS[key, args]


def _chunk_params(model: ModelConfig, tp: int, ep: int, kinds: tuple, pre: bool, post: bool, pp: int,
                  experts: bool) -> list:
    """(numel, alone, unit, Tensor) of one chunk's trainable parameters of one buffer (dense or expert) in
    forward order (engine.planner.params.chunk_tensors): `alone`, the tied embedding's bucket of its own; the
    tensor's tag marks what backward reaches out of the layout's order (`_arrival`)."""
    return [(t.numel, t.tied, unit, t) for unit, t in chunk_tensors(model, tp, ep, kinds, pre, post, pp)
            if t.trained and t.expert == experts]


def _arrival(tags: list) -> list:
    """Positions in the layout (forward order reversed) in the order backward produces the gradients: the
    layout's order, except that a LayerNorm's weight comes before its bias."""
    order = list(range(len(tags)))
    j = 0
    while j + 1 < len(order):
        if (tags[order[j]], tags[order[j + 1]]) == ("norm_b", "norm_w"):
            order[j], order[j + 1] = order[j + 1], order[j]
            j += 1
        j += 1
    return order


def _fill(model: ModelConfig, tp: int, ep: int, kinds: tuple, pre: bool, post: bool, pp: int, experts: bool,
          bucket_numel: int, pad: int, by_unit: bool) -> ChunkLayout:
    """One chunk's buckets (grad_buffer.GradBuffer._layout). `kinds`: the chunk's layers, True for an MoE layer;
    `by_unit`: optim_grads_params (cut where the unit changes, never at bucket_numel)."""
    layout = list(reversed(_chunk_params(model, tp, ep, kinds, pre, post, pp, experts)))
    bucket_of, buckets = cut_buckets([(numel, alone, u if by_unit else None) for numel, alone, u, _ in layout],
                                     None if by_unit else bucket_numel)
    units: dict = {}
    muon, fp8, filled = [[] for _ in buckets], [[] for _ in buckets], [0] * len(buckets)
    for (numel, _, u, t), b in zip(layout, bucket_of):
        for name in (u, "embedding") if t.tag == "word" else (u,):
            units.setdefault(name, [])
            if b not in units[name]:
                units[name].append(b)
        for spans, holds in ((muon, t.tag in MUON_TAGS), (fp8, t.fp8)):
            if holds:
                spans[b].append((filled[b], filled[b] + numel))
        filled[b] += numel
    order = (("embedding",) if pre else ()) + tuple(range(len(kinds))) + (("head",) if post else ())
    return ChunkLayout(tuple((b, -(-b // pad) * pad) for b in buckets),
                       tuple(bucket_of[i] for i in _arrival([t.tag for *_, t in layout])),
                       {u: tuple(b) for u, b in units.items()}, tuple(u for u in order if u in units),
                       tuple(tuple(spans) for spans in muon), tuple(tuple(spans) for spans in fp8))


def rank_chunks(model: ModelConfig, layout: Layout, rank: int, experts: bool = False,
                bucket_numel: Optional[int] = None) -> list:
    """The ChunkLayout of each chunk of pipeline rank `rank`'s dense (or expert) grad buffer, in the buffer's
    order (the last chunk first)."""
    moe = set(model.moe_layers()) if model.num_experts else set()
    sharded = layout.sharding.optimizer
    n = (layout.expert_shard_group if experts else layout.shard_group) if sharded else 1
    pad = SHARD_ALIGN * n if sharded else 1
    key = _model_key(model, layout.tp, layout.ep)
    first, last = end_ranks(layout)
    chunks = stage_layer_ids(model.num_layers, layout)[rank]
    out = []
    for c in reversed(range(len(chunks))):
        pre = rank == first and c == 0
        post = rank == last and c == len(chunks) - 1
        out.append(_chunk_layout(key, model, tuple(i in moe for i in chunks[c]), pre, post, layout.pp, experts,
                                 bucket_numel or DEFAULT_BUCKET_NUMEL, pad, layout.sharding.params))
    return out


def rank_buckets(model: ModelConfig, layout: Layout, rank: int, experts: bool = False,
                 bucket_numel: Optional[int] = None) -> list:
    """(used, padded) elements of every bucket of pipeline rank `rank`'s dense (or expert) grad buffer."""
    return [b for chunk in rank_chunks(model, layout, rank, experts, bucket_numel) for b in chunk.buckets]


def _buffers(model: ModelConfig, layout: Layout, rank: int, bucket_numel: Optional[int]) -> list:
    """(replicas, chunk layouts) of the rank's dense buffer and, with MoE layers on it, its expert buffer."""
    out = [(layout.shard_group, rank_chunks(model, layout, rank, False, bucket_numel))]
    experts = rank_chunks(model, layout, rank, True, bucket_numel) if model.num_experts else []
    if any(c.buckets for c in experts):
        out.append((layout.expert_shard_group, experts))
    return out


def rank_state_bytes(model: ModelConfig, layout: Layout, precision: str, rank: int, bucket_numel: Optional[int] = None,
                     split: Optional[tuple] = None, optimizer: str = "adam") -> tuple:
    """(weights, gradients, optimizer state) bytes data-parallel rank 0 of pipeline rank `rank` keeps between
    steps: Optimizer.memory_bytes() exactly (Adam's scalar step counts left out), weights plus the fp32 frozen
    MoE expert bias. `split`: the rank's param_split_per_rank entry, when the caller has it. `optimizer` muon:
    its weights keep one moment instead of two (under it another replica may hold a little more than rank 0,
    where its slice has more of AdamW's elements)."""
    sharding, muon = layout.sharding, optimizer == "muon"
    weights = grads = state = 0
    master = MASTER_BYTES if (precision != "fp32" or sharding.optimizer) else 0
    dense, experts, frozen = split or param_split_per_rank(model, layout)[rank]
    for n, chunks in _buffers(model, layout, rank, bucket_numel):
        buckets = [(b, spans) for chunk in chunks for b, spans in zip(chunk.buckets, chunk.muon)]
        total = sum(p for (_, p), _ in buckets)
        owned = [min(u, p // n) if sharding.optimizer else p for (u, p), _ in buckets]
        state += sum(owned) * (MOMENTS + master)
        if muon:  # the momentum of the Muon weights' elements rank 0 owns (the first `owned` of each bucket)
            state -= (MOMENTS - MUON_MOMENTUM_BYTES) * sum(max(0, min(hi, k) - lo) for k, (_, spans) in
                                                           zip(owned, buckets) for lo, hi in spans)
        if not sharding.optimizer:
            grads += total * GRAD_BYTES
            continue
        grads += (total // n if sharding.grads else total) * GRAD_BYTES
        weights += total // n * PARAM_BYTES[precision]
    if not sharding.params:
        weights = (dense + experts) * PARAM_BYTES[precision]
    return weights + 4 * frozen, grads, state


# ZeRO-2/3 gradient staging, from engine/optim/grad_buffer.py: `_hook` allocates a bucket's full-size fp32
# staging at the first gradient of a microbatch round; `_end_round` runs once each of the bucket's parameters
# has had one more gradient: it first completes the reduce-scatter in flight (`_complete_inflight`: at most one
# round in flight per buffer), then reduce-scatters this round's staging and drops it. Without
# --overlap-grad-reduce (or with one replica) that reduction completes at once, before the next gradient; with
# it the staging stays alive, in flight, until the next round of the buffer ends. So at any instant
#     staged = the buckets whose round is open + (overlap, n > 1) one bucket in flight,
# a bucket's round being open from the first to the last gradient of its parameters. Backward produces them in
# the layout's order (forward order reversed: the output weight first) except that a LayerNorm's weight comes
# before its bias (`_arrival`; the next bucket opens early when that pair straddles a boundary; at pp 1 the tied
# word embedding, laid out last, also completes last). `_chunk_staging` replays that order and takes
# the most staged at any allocation (where the engine measures peak_staging_bytes), with the bucket in flight at
# a chunk's first gradient the largest one that can close a backward (the previous microbatch's or chunk's); so
# ZeRO-2 holds two or three buckets, ZeRO-3 (whole units as buckets) about one unit, or two with overlap. Under a
# zero-bubble schedule the weights' gradients come in the deferred W pass, after the norms' and biases' in B,
# with other passes in between: any bucket may then be open, and the allowance is all of them plus one in flight.

_STAGED: dict = {}


def _chunk_staging(chunk: ChunkLayout, carried: int, overlap: bool) -> tuple:
    """(most elements staged at once, the bucket closing last) over one backward pass of one chunk; `carried`:
    the bucket in flight when it starts. Cached by the chunk's identity (layouts come from `_chunk_layout`'s
    cache, so a search meets the same few again and again); the entry holds the chunk, so its id stays its."""
    key = (id(chunk), carried, overlap)
    hit = _STAGED.get(key)
    if hit is None or hit[0] is not chunk:
        if len(_STAGED) > 65536:
            _STAGED.clear()
        hit = _STAGED[key] = (chunk, _replay_staging(chunk, carried, overlap))
    return hit[1]


def _replay_staging(chunk: ChunkLayout, carried: int, overlap: bool) -> tuple:
    left, sizes = Counter(chunk.arrival), [p for _, p in chunk.buckets]
    staged, held, peak, inflight, last = set(), 0, 0, carried, 0  # held: the staged buckets' elements
    for b in chunk.arrival:
        if b not in staged:
            staged.add(b)
            held += sizes[b]
            peak = max(peak, inflight + held)
        left[b] -= 1
        if not left[b]:
            staged.discard(b)
            held -= sizes[b]
            last = sizes[b]
            inflight = last if overlap else 0
    return peak, last


def _staging(chunks: list, overlap: bool, split_backward: bool) -> int:
    """Most fp32 staging elements one grad buffer holds at once (see the comment above)."""
    sizes = [p for c in chunks for _, p in c.buckets]
    if not sizes:
        return 0
    if split_backward:
        return sum(sizes) + (max(sizes) if overlap else 0)
    carried = max(_chunk_staging(c, 0, overlap)[1] for c in chunks) if overlap else 0
    return max(_chunk_staging(c, carried, overlap)[0] for c in chunks)


def _gathered(buffers: list, prefetch: bool) -> int:
    """Most elements of full-size weights optim_grads_params holds at once (param_shard.ParamSharder): one unit's
    buckets (each bucket once: the tied embedding's belongs to two units), with `prefetch` the next unit's too
    (forward: u_i and u_i+1; backward: u_i and u_i-1), within one chunk."""
    peak = 0
    for same in zip(*[chunks for _, chunks in buffers]):  # one chunk's dense (every unit has some) and experts
        order = same[0].order
        for i in range(len(order)):
            held = order[i:i + 2] if prefetch else order[i:i + 1]
            peak = max(peak, sum(chunk.buckets[b][1] for chunk in same
                                 for b in {b for u in held for b in chunk.units.get(u, ())}))
    return peak


def rank_transient_bytes(model: ModelConfig, layout: Layout, precision: str, rank: int,
                         bucket_numel: Optional[int] = None, overlap_grad_reduce: bool = False,
                         overlap_param_gather: bool = False) -> tuple:
    """(staging, gathered) bytes pipeline rank `rank` holds at most on top of rank_state_bytes: ZeRO-2/3's fp32
    gradient staging (the dense and expert buffers' peaks added), and full-size weights in the training dtype:
    ZeRO-3's gathered units (two with `overlap_param_gather`), ZeRO-1/2's all-gather target of the step (none
    without other replicas; with `overlap_param_gather` the padding of the flat buckets the weights are gathered
    into in place)."""
    sharding = layout.sharding
    if not sharding.optimizer:
        return 0, 0
    buffers = _buffers(model, layout, rank, bucket_numel)
    staging = 0
    if sharding.grads:
        split = layout.schedule.split_backward
        staging = sum(_staging(chunks, overlap_grad_reduce and n > 1, split) for n, chunks in buffers)
    if sharding.params:
        gathered = _gathered(buffers, overlap_param_gather)
    elif overlap_param_gather:
        gathered = sum(padded - used for _, chunks in buffers for c in chunks for used, padded in c.buckets)
    else:
        gathered = max([p for n, chunks in buffers if n > 1 for c in chunks for _, p in c.buckets] or [0])
    return staging * GRAD_BYTES, gathered * PARAM_BYTES[precision]


def dp_bytes_per_step(params: float, layout: Layout, precision: str, num_microbatches: int,
                      grad_bytes: int = GRAD_BYTES, n: Optional[int] = None,
                      gathered: Optional[float] = None) -> dict:
    """Bytes one rank sends per step over its n replicas (dp x cp) for `params` parameters: gradient reduction
    and weight gathering, ring volumes (see the module doc). `gathered`: the bytes one gather of the weights
    produces when not theirs in the run's precision (--fp8-param-gather: fp8_gather_bytes(...).gathered)."""
    n = n or layout.shard_group
    if n == 1:
        return dict(grad_reduce=0.0, param_gather=0.0)
    ring = (n - 1) / n
    g, m = grad_bytes * params, num_microbatches
    w = PARAM_BYTES[precision] * params if gathered is None else gathered
    sharding = layout.sharding
    if not sharding.optimizer:
        return dict(grad_reduce=2 * ring * g, param_gather=0.0)
    grad_reduce = (m if sharding.grads else 1) * ring * g
    return dict(grad_reduce=grad_reduce, param_gather=(2 * m if sharding.params else 1) * ring * w)

"""Parameters and memory per GPU for a parallel layout, analytically (no model is built).

Parameters follow the structure engine/model.py builds: embedding [V_pad, h] split over tp (and
learned positions [max_pos, h] replicated), per layer two norms (replicated), fused QKV and fc1
column-parallel, attention output and fc2 row-parallel with their biases replicated, a final norm
and the output layer [V_pad, h] on the last stage (when the embedding is tied and pp > 1, the last
stage holds its own copy of the embedding).

Mixture of experts (engine/moe, engine/model.py `moe_block`): an MoE layer keeps the norms and attention of
a dense one; its router [E, h] is replicated (and an fp32 expert bias [E], not trained), its routed experts
fc1 [E, h, 2F or F] and fc2 [E, F, h] are split over the ep ranks (E/ep each) and replicated over tp, and
its shared expert is a tensor-parallel MLP. Expert gradients reduce, and the distributed optimizer shards
their state, over the dp/ep x cp ranks holding the same experts; dense parameters over dp x cp.

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
order, with A chunks between F and B and W between B and W (engine/planner/sharding.py: `zb_in_flight`).

Weights, gradients and optimizer state per data-parallel sharding strategy: `state_bytes` (the ZeRO
formulas) and engine/planner/sharding.py (the engine's exact bucket layout).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from engine.attention_mask import AttentionMask
from engine.config import ModelConfig
from engine.flops import UNIT, Costs, split_backward_costs
from engine.layout import Layout, PipelineSchedule
from engine.pipeline.schedules import peak_in_flight, schedule_order

# Bytes per parameter, as engine/optim allocates them: 2-byte weights in bf16/fp16, an fp32 main-grad
# buffer (microbatch gradients accumulate in fp32), Adam m and v in fp32, and an fp32 master copy
# whenever the weights are not fp32 or the state is sharded (a shard cannot alias the weights).
# Mixed precision thus costs 18 B/param, or 6 + 12/dp with the distributed optimizer, as in
# Megatron-LM's distributed-optimizer guide.
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4
ADAM_MOMENT_BYTES = 8
MASTER_BYTES = 4

# Output layer and cross entropy on the last stage, per logit: the 2-byte logits are the only
# vocabulary-sized tensor (engine/parallel/cross_entropy.py reduces them chunk by chunk and writes the gradient
# in place over them).
LOGIT_BYTES = 2

# Not counted by the tensors above: the allocator's fragmentation and rounding (fraction of what is
# allocated; PyTorch's caching allocator typically reserves 5-15% more than it allocates), and a fixed
# reserve for the CUDA context, cuBLAS workspaces and NCCL buffers (~1.5-2.5 GiB per process).
MEMORY_FRAGMENTATION = 0.10
MEMORY_RESERVED_GIB = 2.0

GIB = 2.0 ** 30


def stage_layer_ids(num_layers: int, layout: Layout) -> tuple:
    """Global layer ids per (pipeline rank, model chunk): the engine's own split (engine.pipeline.partition).

    Uneven first/last stages with an interleaved schedule (the engine does not run it; Llama 3 405B did)
    split each rank's layers over its chunks as evenly as they go, for evaluating published layouts. ZB-V's V
    puts chunk 1 of rank r on stage 2pp-1-r."""
    return _stage_ids(num_layers, layout.schedule, layout.first_stage_layers, layout.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_ids(num_layers: int, schedule: PipelineSchedule, first: Optional[int], last: Optional[int]) -> tuple:
    pp, vpp = schedule.pp, schedule.vpp
    if (first is not None or last is not None) and vpp > 1:
        split = Layout(pp=pp, first_stage_layers=first, last_stage_layers=last)
        out = []
        for r in range(pp):
            ids = tuple(split.layer_ids(num_layers, r, 0))
            sizes = [len(ids) // vpp + (c < len(ids) % vpp) for c in range(vpp)]
            out.append(tuple(ids[sum(sizes[:c]):sum(sizes[:c + 1])] for c in range(vpp)))
        return tuple(out)
    split = Layout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last, pipeline_schedule=schedule.name)
    return tuple(tuple(tuple(split.layer_ids(num_layers, r, c)) for c in range(vpp)) for r in range(pp))


def stage_layer_counts(num_layers: int, layout: Layout) -> tuple:
    """Layers per (pipeline rank, model chunk), see stage_layer_ids."""
    return _stage_counts(num_layers, layout.schedule, layout.first_stage_layers, layout.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_counts(num_layers: int, schedule: PipelineSchedule, first: Optional[int], last: Optional[int]) -> tuple:
    return tuple(tuple(len(ids) for ids in chunks) for chunks in _stage_ids(num_layers, schedule, first, last))


def end_ranks(layout: Layout) -> tuple:
    """(pipeline rank with the embedding, pipeline rank with the output layer): ZB-V's V puts both on rank 0."""
    return 0, layout.schedule.loss_rank


def moe_layers_per_rank(model: ModelConfig, layout: Layout) -> list:
    """MoE layers held by each pipeline rank."""
    if not model.num_experts:
        return [0] * layout.pp
    moe = set(model.moe_layers())
    return [sum(i in moe for ids in chunks for i in ids) for chunks in stage_layer_ids(model.num_layers, layout)]


def _mlp_params(model: ModelConfig, ffn: int, tp: int) -> int:
    """A tensor-parallel MLP of width ffn on one tp rank: fc1 (gate and up stacked with SwiGLU) column-parallel,
    fc2 row-parallel with its bias replicated."""
    bias = not model.disable_bias_linear
    fc1_out = 2 * ffn if model.swiglu else ffn
    return fc1_out * (model.hidden_size + bias) // tp + model.hidden_size * ffn // tp + bias * model.hidden_size


def _attention_and_norms(model: ModelConfig, tp: int) -> int:
    h, d = model.hidden_size, model.head_dim()
    nq, nkv = model.num_attention_heads, model.resolved_query_groups()
    bias = not model.disable_bias_linear
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    qkv = (nq + 2 * nkv) * d * (h + (bias or model.add_qkv_bias)) // tp
    proj = h * nq * d // tp + bias * h
    return 2 * norm + qkv + proj


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one dense transformer layer held by one tensor-parallel rank."""
    return _attention_and_norms(model, tp) + _mlp_params(model, model.resolved_ffn_hidden_size(), tp)


def moe_layer_params(model: ModelConfig, tp: int, ep: int = 1) -> tuple:
    """(dense, experts, frozen) parameters of one MoE layer on one (tp, ep) rank: dense = norms, attention,
    router and shared expert (reduced over dp x cp); experts = this rank's E/ep routed experts (not split by
    tp); frozen = the fp32 expert bias (not trained: no gradient, no optimizer state)."""
    h, E, f = model.hidden_size, model.num_experts, model.resolved_moe_ffn_hidden_size()
    shared = model.moe_shared_expert_intermediate_size
    dense = _attention_and_norms(model, tp) + E * h + (_mlp_params(model, shared, tp) if shared else 0)
    experts = E // ep * ((3 if model.swiglu else 2) * h * f)
    return dense, experts, E if model.moe_router_enable_expert_bias else 0


def embedding_params(model: ModelConfig, tp: int) -> int:
    h = model.hidden_size
    positions = (model.max_position_embeddings or model.seq_length) * h \
        if model.position_embedding_type == "learned_absolute" else 0
    return model.padded_vocab_size(tp) * h // tp + positions


def head_params(model: ModelConfig, tp: int, pp: int) -> int:
    """Final norm and output layer (or the tied embedding's copy on the last stage when pp > 1)."""
    h = model.hidden_size
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    needs_copy = model.untie_embeddings_and_output_weights or pp > 1
    return norm + (model.padded_vocab_size(tp) * h // tp if needs_copy else 0)


def param_split_per_rank(model: ModelConfig, layout: Layout) -> list:
    """(dense, experts, frozen) parameters held by each pipeline rank (any tp and ep rank: equal counts);
    see moe_layer_params. Dense models have (n, 0, 0)."""
    counts = stage_layer_counts(model.num_layers, layout)
    n_moe = moe_layers_per_rank(model, layout)
    per_layer = layer_params(model, layout.tp)
    moe = moe_layer_params(model, layout.tp, layout.ep) if model.num_experts else (0, 0, 0)
    first, last = end_ranks(layout)
    out = []
    for r, chunks in enumerate(counts):
        n = (sum(chunks) - n_moe[r]) * per_layer + n_moe[r] * moe[0]
        if r == first:
            n += embedding_params(model, layout.tp)
        if r == last:
            n += head_params(model, layout.tp, layout.pp)
        out.append((n, n_moe[r] * moe[1], n_moe[r] * moe[2]))
    return out


def params_per_rank(model: ModelConfig, layout: Layout) -> list:
    """Parameters held by each pipeline rank (any tensor- or expert-parallel rank: they hold equal counts)."""
    return [sum(split) for split in param_split_per_rank(model, layout)]


def layer_activation_bytes(model: ModelConfig, seq_length: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           flash_attention: bool = False, cp: int = 1, moe: bool = False) -> float:
    """Activation bytes one layer keeps for backward, for one microbatch on one tp rank.

    Under context parallelism a rank holds seq_length/cp tokens of each sequence and saves only its own
    Q, K, V (the ring re-sends the other ranks' K/V in backward), so every term is divided by cp.
    An MoE layer (`moe`) replaces the MLP term with `moe_mlp_activation_bytes`."""
    s, b, h = seq_length // cp, micro_batch, model.hidden_size
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return 2 * s * b * h / sp
    d, nq, nkv = model.head_dim(), model.num_attention_heads, model.resolved_query_groups()
    ffn = model.resolved_ffn_hidden_size()
    # Not split by tp (split by sp): two norm inputs (4), QKV input (2), MLP input (2), and with residual
    # dropout its two 1-byte masks (2).
    replicated = (8 + 2 * (model.hidden_dropout > 0)) * s * b * h
    # Split by tp: Q and K for the scores, V, the attention output (projection input), the MLP
    # hidden activations (GELU: fc1 output and GELU output; SwiGLU: gate+up output and their product).
    mlp = (6 if model.swiglu else 4) * ffn * s * b if not moe else 0
    split = 2 * s * b * (nq * d + nkv * d) + 2 * s * b * nkv * d + 2 * s * b * nq * d + mlp
    # Softmax output (2) per score, and with attention dropout its mask (1) and the dropout output (2).
    per_score = 2 + 3 * (model.attention_dropout > 0)
    keys = AttentionMask.of(model).keys_per_query(s * cp)  # each local query against the whole sequence
    scores = 0 if (flash_attention or recompute == "selective") else per_score * nq * s * keys * b
    routed = moe_mlp_activation_bytes(model, s * b, tp, sp) if moe else 0.0
    return replicated / sp + (split + scores) / tp + routed


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


@dataclass
class Memory:
    """Bytes on the most loaded GPU."""
    rank: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    transient: float  # the largest weight's own gradient, alive until the hook adds it to the fp32 buffer
    staging: float = 0.0   # ZeRO-2/3: full-size fp32 gradients of the buckets being reduced (sharding.py)
    gathered: float = 0.0  # full-size weights: ZeRO-3's gathered units, ZeRO-1/2's all-gather target

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should report."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.transient
                + self.staging + self.gathered)

    @property
    def total(self) -> float:
        """Device memory the process needs: allocated plus fragmentation plus the fixed reserve."""
        return self.allocated * (1 + MEMORY_FRAGMENTATION) + MEMORY_RESERVED_GIB * GIB


def state_bytes(params: int, layout: Layout, precision: str, experts: int = 0, frozen: int = 0, unit: int = 0,
                bucket: int = 0) -> tuple:
    """(weights, gradients, optimizer state) bytes on one GPU by the ZeRO formulas (Rajbhandari et al. 2020,
    sec. 5) in this engine's dtypes, for `params` dense parameters, `experts` expert parameters (sharded over
    dp/ep x cp instead of dp x cp) and `frozen` fp32 ones with no gradient or state (the MoE expert bias):

        no_shard            weights W·P   grads 4·P           state (8 + master)·P, master 4 unless fp32
        optim (ZeRO-1)      W·P           4·P                 12·P/n
        optim_grads (-2)    W·P           4·P/n + 4·bucket    12·P/n
        optim_grads_params  W·(P/n+unit)  4·P/n + 4·bucket    12·P/n

    W the training dtype's bytes, n the ranks sharding (dp x cp); `bucket` the elements of fp32 gradient
    staging allowed for, `unit` the weights of the gathered unit(s) (a layer). engine/planner/sharding.py gives
    the parts kept between steps exactly as the engine lays them out (shard padding included) and the
    staging and gathering the engine can hold (`rank_transient_bytes`)."""
    sharding = layout.sharding
    n, ne = (layout.shard_group, layout.expert_shard_group) if sharding.optimizer else (1, 1)
    mine, everything = params / n + experts / ne, params + experts
    master = MASTER_BYTES if (precision != "fp32" or sharding.optimizer) else 0
    weights = (mine + unit if sharding.params else everything) * PARAM_BYTES[precision]
    grads = (mine + bucket if sharding.grads else everything) * GRAD_BYTES
    return weights + 4 * frozen, grads, mine * (ADAM_MOMENT_BYTES + master)


def _largest_weight(model: ModelConfig, layout: Layout) -> int:
    """Elements of the largest weight inside a layer on one rank (its gradient is briefly whole)."""
    ffn = model.resolved_ffn_hidden_size() * (2 if model.swiglu else 1)
    largest = max(ffn, (model.num_attention_heads + 2 * model.resolved_query_groups())
                  * model.head_dim()) * model.hidden_size // layout.tp
    if model.num_experts:
        fc1 = model.resolved_moe_ffn_hidden_size() * (2 if model.swiglu else 1)
        largest = max(largest, model.num_experts // layout.ep * fc1 * model.hidden_size)
    return largest


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


def memory_per_gpu(model: ModelConfig, layout: Layout, seq_length: int, num_microbatches: int,
                   precision: str = "bf16", flash_attention: bool = True, bucket_numel: Optional[int] = None,
                   overlap_grad_reduce: bool = False, overlap_param_gather: bool = False) -> Memory:
    """Peak memory of the pipeline rank that needs the most; weights, gradients and optimizer state as the
    engine allocates them (engine/planner/sharding.py, buckets of `bucket_numel`: the engine's default), and
    the sharding strategies' staging and gathering (--overlap-grad-reduce keeps one more bucket staged under
    ZeRO-2/3, --overlap-param-gather one more unit gathered under ZeRO-3; both off by default, as in the engine)."""
    from engine.planner.sharding import rank_state_bytes, rank_transient_bytes
    counts = stage_layer_counts(model.num_layers, layout)
    n_moe = moe_layers_per_rank(model, layout)
    splits = param_split_per_rank(model, layout)

    def act(recompute: str, moe: bool) -> float:
        return layer_activation_bytes(model, seq_length, layout.micro_batch_size, layout.tp, layout.sequence_parallel,
                                      recompute, flash_attention, layout.cp, moe)
    act_dense = act(layout.recompute, False)
    act_moe = act(layout.recompute, True) if any(n_moe) else 0.0
    store = w_store_bytes(model, seq_length, layout.micro_batch_size, layout.tp, layout.sequence_parallel, layout.cp)
    store_moe = store + act("none", True) - act("none", False) if any(n_moe) else 0.0
    costs = split_backward_costs(model, seq_length, layout.recompute)  # what a zero-bubble order is built for
    # Full recomputation rebuilds one layer's complete activations during its backward pass.
    workspace = 0.0
    if layout.recompute == "full":
        workspace = max(act("none", False), act("none", True) if any(n_moe) else 0.0)
    vocab_shard = model.padded_vocab_size(layout.tp) // layout.tp
    logits = LOGIT_BYTES * seq_length // layout.cp * layout.micro_batch_size * vocab_shard
    largest_layer_weight = _largest_weight(model, layout)
    first, last = end_ranks(layout)
    best, classes = None, {}
    for r, chunks in enumerate(counts):
        # Ranks alike in layers and ends hold the same state; without a zero-bubble schedule the first of them
        # holds the most activations (in-flight counts fall with the rank), so it stands for the others.
        cls = (chunks, n_moe[r], r == first, r == last)
        if cls in classes and not layout.schedule.split_backward:
            continue
        if cls not in classes:
            classes[cls] = rank_state_bytes(model, layout, precision, r, bucket_numel, splits[r]), \
                rank_transient_bytes(model, layout, precision, r, bucket_numel, overlap_grad_reduce,
                                     overlap_param_gather)
        dense_layers = sum(chunks) - n_moe[r]
        per_chunk = (dense_layers * act_dense + n_moe[r] * act_moe) / len(chunks)
        store_chunk = (dense_layers * store + n_moe[r] * store_moe) / len(chunks)
        acts = in_flight_bytes(layout, r, num_microbatches, per_chunk, store_chunk, costs)
        acts += workspace if sum(chunks) else 0.0
        ends = r in (first, last)
        largest = max(largest_layer_weight if sum(chunks) else 0, vocab_shard * model.hidden_size if ends else 0)
        state, (staging, gathered) = classes[cls]
        mem = Memory(r, sum(splits[r]), *state, acts, logits if r == last else 0.0, largest * PARAM_BYTES[precision],
                     staging, gathered)
        if best is None or mem.allocated > best.allocated:
            best = mem
    return best

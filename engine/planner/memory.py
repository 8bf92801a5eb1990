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
whatever the recomputation. Dropout masks (2·s·b·h) are kept in the count even at dropout 0: they are
part of the published formula and act as a small margin.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from engine.config import ModelConfig
from engine.pipeline.partition import stage_layers
from engine.pipeline.schedules import peak_in_flight

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


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"            # none | selective | full
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    first_stage_layers: Optional[int] = None   # uneven pipeline split (--decoder-first-pipeline-num-layers)
    last_stage_layers: Optional[int] = None
    cp: int = 1                        # context parallel: each sequence split over cp ranks
    ep: int = 1                        # expert parallel, carved from dp: the experts split over ep dp ranks

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks that hold replicas of the same weights: gradients reduce over them and the distributed
        optimizer shards over them (dp x cp: CP ranks replicate the weights)."""
        return self.dp * self.cp

    @property
    def expert_shard_group(self) -> int:
        """Ranks holding the same experts (dp/ep x cp): the experts' gradients reduce over them and their
        optimizer state shards over them."""
        return self.dp // self.ep * self.cp


def stage_layer_ids(num_layers: int, layout: Layout) -> tuple:
    """Global layer ids per (pipeline rank, model chunk): the engine's own split (engine.pipeline.partition).

    Uneven first/last stages with an interleaved schedule (the engine does not run it; Llama 3 405B did)
    split each rank's layers over its chunks as evenly as they go, for evaluating published layouts."""
    return _stage_ids(num_layers, layout.pp, layout.vpp, layout.first_stage_layers, layout.last_stage_layers)


@functools.lru_cache(maxsize=4096)
def _stage_ids(num_layers: int, pp: int, vpp: int, first: Optional[int], last: Optional[int]) -> tuple:
    if (first is not None or last is not None) and vpp > 1:
        out = []
        for r in range(pp):
            ids = tuple(stage_layers(num_layers, pp, 1, r, 0, first, last))
            sizes = [len(ids) // vpp + (c < len(ids) % vpp) for c in range(vpp)]
            out.append(tuple(ids[sum(sizes[:c]):sum(sizes[:c + 1])] for c in range(vpp)))
        return tuple(out)
    return tuple(tuple(tuple(stage_layers(num_layers, pp, vpp, r, c, first, last)) for c in range(vpp))
                 for r in range(pp))


def stage_layer_counts(num_layers: int, layout: Layout) -> list:
    """Layers per (pipeline rank, model chunk), see stage_layer_ids."""
    return [[len(ids) for ids in chunks] for chunks in stage_layer_ids(num_layers, layout)]


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
    out = []
    for r, chunks in enumerate(counts):
        n = (sum(chunks) - n_moe[r]) * per_layer + n_moe[r] * moe[0]
        if r == 0:
            n += embedding_params(model, layout.tp)
        if r == layout.pp - 1:
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
    # Not split by tp (split by sp): two norm inputs (4), QKV input (2), MLP input (2), two dropout masks (2).
    replicated = 10 * s * b * h
    # Split by tp: Q and K for the scores, V, the attention output (projection input), the MLP
    # hidden activations (GELU: fc1 output and GELU output; SwiGLU: gate+up output and their product).
    mlp = (6 if model.swiglu else 4) * ffn * s * b if not moe else 0
    split = 2 * s * b * (nq * d + nkv * d) + 2 * s * b * nkv * d + 2 * s * b * nq * d + mlp
    # Softmax output (2), its dropout mask (1) and dropout output (2) per score.
    scores = 0 if (flash_attention or recompute == "selective") else 5 * nq * s * s * cp * b
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

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should report."""
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.transient

    @property
    def total(self) -> float:
        """Device memory the process needs: allocated plus fragmentation plus the fixed reserve."""
        return self.allocated * (1 + MEMORY_FRAGMENTATION) + MEMORY_RESERVED_GIB * GIB


def state_bytes(params: int, layout: Layout, precision: str, experts: int = 0, frozen: int = 0) -> tuple:
    """(weights, gradients, optimizer state) bytes on one GPU for `params` dense parameters, plus `experts`
    expert parameters (their state sharded over dp/ep x cp instead of dp x cp) and `frozen` fp32 ones with no
    gradient or optimizer state (the MoE router's expert bias)."""
    dist = layout.distributed_optimizer
    shard, expert_shard = (layout.shard_group, layout.expert_shard_group) if dist else (1, 1)
    master = MASTER_BYTES if (precision != "fp32" or dist) else 0
    return ((params + experts) * PARAM_BYTES[precision] + 4 * frozen, (params + experts) * GRAD_BYTES,
            (params / shard + experts / expert_shard) * (ADAM_MOMENT_BYTES + master))


def _largest_weight(model: ModelConfig, layout: Layout) -> int:
    """Elements of the largest weight inside a layer on one rank (its gradient is briefly whole)."""
    ffn = model.resolved_ffn_hidden_size() * (2 if model.swiglu else 1)
    largest = max(ffn, (model.num_attention_heads + 2 * model.resolved_query_groups())
                  * model.head_dim()) * model.hidden_size // layout.tp
    if model.num_experts:
        fc1 = model.resolved_moe_ffn_hidden_size() * (2 if model.swiglu else 1)
        largest = max(largest, model.num_experts // layout.ep * fc1 * model.hidden_size)
    return largest


def memory_per_gpu(model: ModelConfig, layout: Layout, seq_length: int, num_microbatches: int,
                   precision: str = "bf16", flash_attention: bool = True) -> Memory:
    """Peak memory of the pipeline rank that needs the most."""
    counts = stage_layer_counts(model.num_layers, layout)
    n_moe = moe_layers_per_rank(model, layout)
    splits = param_split_per_rank(model, layout)

    def act(recompute: str, moe: bool) -> float:
        return layer_activation_bytes(model, seq_length, layout.micro_batch_size, layout.tp, layout.sequence_parallel,
                                      recompute, flash_attention, layout.cp, moe)
    act_dense = act(layout.recompute, False)
    act_moe = act(layout.recompute, True) if any(n_moe) else 0.0
    # Full recomputation rebuilds one layer's complete activations during its backward pass.
    workspace = 0.0
    if layout.recompute == "full":
        workspace = max(act("none", False), act("none", True) if any(n_moe) else 0.0)
    vocab_shard = model.padded_vocab_size(layout.tp) // layout.tp
    logits = LOGIT_BYTES * seq_length // layout.cp * layout.micro_batch_size * vocab_shard
    largest_layer_weight = _largest_weight(model, layout)
    best = None
    for r, chunks in enumerate(counts):
        per_chunk = ((sum(chunks) - n_moe[r]) * act_dense + n_moe[r] * act_moe) / len(chunks)
        acts = peak_in_flight(layout.pp, layout.vpp, r, num_microbatches) * per_chunk
        acts += workspace if sum(chunks) else 0.0
        ends = r == 0 or r == layout.pp - 1
        largest = max(largest_layer_weight if sum(chunks) else 0, vocab_shard * model.hidden_size if ends else 0)
        dense, experts, frozen = splits[r]
        mem = Memory(r, dense + experts + frozen, *state_bytes(dense, layout, precision, experts, frozen), acts,
                     logits if r == layout.pp - 1 else 0.0, largest * PARAM_BYTES[precision])
        if best is None or mem.allocated > best.allocated:
            best = mem
    return best

"""Memory per GPU for a parallel layout, analytically (no model is built): what the most loaded pipeline rank
holds at its peak, assembled from the planner's parts.

Parameters per rank are engine/planner/params.py's inventory, activations per layer and the microbatch-chunks
in flight engine/planner/activations.py's; weights, gradients and optimizer state per data-parallel sharding
strategy are `state_bytes` (the ZeRO formulas) and engine/planner/sharding.py (the engine's exact bucket
layout, with the staging and gathering each strategy adds; --fp8-param-gather's codes and payloads are
engine/planner/fp8_gather.py's: under ZeRO-1/2 the codes and gathered payloads kept, under ZeRO-3 each rank's
own payloads kept and the unit gathers' code tensors and in-flight payloads at their most; without that flag
the FP8 weights a step's schedule keeps quantized, `fp8_held_bytes`). On top come the
logits on the last stage, the largest weight's own gradient before the hook adds it to the fp32 buffer, full
recomputation's workspace, and (`Memory.total`) the allocator's fragmentation and the fixed CUDA/NCCL reserve.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.config import ModelConfig
from engine.flops import attention_matrices, attention_splits
from engine.planner.counts import degrees, memoised, param_split_per_rank, split_backward_costs
from engine.planner.fp8_gather import fp8_gather_bytes
from engine.layout import Layout
from engine.planner.activations import in_flight_bytes, layer_activation_bytes, w_store_bytes
from engine.planner.params import ADAM_MOMENT_BYTES, GRAD_BYTES, MASTER_BYTES, MUON_MOMENTUM_BYTES, PARAM_BYTES
from engine.planner.sharding import rank_chunks, rank_state_bytes, rank_transient_bytes
from engine.planner.stages import end_ranks, moe_layers_per_rank, stage_layer_counts

# Output layer and cross entropy on the last stage, per logit: the 2-byte logits are the only
# vocabulary-sized tensor (engine/parallel/cross_entropy.py reduces them chunk by chunk and writes the gradient
# in place over them).
LOGIT_BYTES = 2

# Not counted by any tensor: the allocator's fragmentation and rounding (fraction of what is
# allocated; PyTorch's caching allocator typically reserves 5-15% more than it allocates), and a fixed
# reserve for the CUDA context, cuBLAS workspaces and NCCL buffers (~1.5-2.5 GiB per process).
MEMORY_FRAGMENTATION = 0.10
# Under --fp8-output-layer the output layer's backward quantizes the logits' gradient (written over the logits by the
# loss) for its two GEMMs, per logit of one head: tensor scaling writes its codes and their transpose (2 bytes);
# blockwise makes an fp32 |x| for its tiles' amaxes (4), the codes (1), then the same along the tokens for the
# weight gradient (1 more kept): about 6 at once.
FP8_LOGIT_GRAD_BYTES = {"tensorwise": 2, "delayed": 2, "blockwise": 6}
MEMORY_RESERVED_GIB = 2.0

GIB = 2.0 ** 30


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
    gathered: float = 0.0  # full-size weights: ZeRO-3's gathered units, ZeRO-1/2's all-gather target (or padding)
    fp8_gather: float = 0.0  # --fp8-param-gather: the FP8 codes and the gathers' payloads (planner/fp8_gather.py;
    # ZeRO-3: its own payloads kept, and the most code tensors and gathered payloads its unit gathers hold)
    fp8_held: float = 0.0  # FP8 weights quantized once for a step's microbatches (fp8_held_bytes)

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should report."""
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.transient
                + self.staging + self.gathered + self.fp8_gather + self.fp8_held)

    @property
    def total(self) -> float:
        """Device memory the process needs: allocated plus fragmentation plus the fixed reserve."""
        return self.allocated * (1 + MEMORY_FRAGMENTATION) + MEMORY_RESERVED_GIB * GIB


def state_bytes(params: int, layout: Layout, precision: str, experts: int = 0, frozen: int = 0, unit: int = 0,
                bucket: int = 0, muon: tuple = (0, 0)) -> tuple:
    """(weights, gradients, optimizer state) bytes on one GPU by the ZeRO formulas (Rajbhandari et al. 2020,
    sec. 5) in this engine's dtypes, for `params` dense parameters, `experts` expert parameters (sharded over
    dp/ep x cp instead of dp x cp) and `frozen` fp32 ones with no gradient or state (the MoE expert bias):

        no_shard            weights W·P   grads 4·P           state (8 + master)·P, master 4 unless fp32
        optim (ZeRO-1)      W·P           4·P                 12·P/n
        optim_grads (-2)    W·P           4·P/n + 4·bucket    12·P/n
        optim_grads_params  W·(P/n+unit)  4·P/n + 4·bucket    12·P/n

    W the training dtype's bytes, n the ranks sharding (dp x cp); `bucket` the elements of fp32 gradient
    staging allowed for, `unit` the weights of the gathered unit(s) (a layer). Under --optimizer muon, `muon` (its
    dense and expert parameters, among the above) keep a 4-byte momentum instead of Adam's 8 bytes of moments.
    engine/planner/sharding.py gives
    the parts kept between steps exactly as the engine lays them out (shard padding included) and the
    staging and gathering the engine can hold (`rank_transient_bytes`)."""
    sharding = layout.sharding
    n, ne = (layout.shard_group, layout.expert_shard_group) if sharding.optimizer else (1, 1)
    mine, everything = params / n + experts / ne, params + experts
    master = MASTER_BYTES if (precision != "fp32" or sharding.optimizer) else 0
    weights = (mine + unit if sharding.params else everything) * PARAM_BYTES[precision]
    grads = (mine + bucket if sharding.grads else everything) * GRAD_BYTES
    muon_mine = muon[0] / n + muon[1] / ne
    return weights + 4 * frozen, grads, mine * (ADAM_MOMENT_BYTES + master) - muon_mine * (ADAM_MOMENT_BYTES -
                                                                                         MUON_MOMENTUM_BYTES)


def _largest_weight(model: ModelConfig, layout: Layout) -> int:
    """Elements of the largest weight inside a layer on one rank (its gradient is briefly whole)."""
    ffn = model.resolved_ffn_hidden_size() * (2 if model.swiglu else 1)
    largest = max([ffn * model.hidden_size // layout.tp]
                  + [rows * cols // (layout.tp if axis is not None else 1)
                     for (rows, cols), axis in zip(attention_matrices(model), attention_splits(model))])
    if model.num_experts:
        fc1 = model.resolved_moe_ffn_hidden_size() * (2 if model.swiglu else 1)
        largest = max(largest, model.num_experts // layout.ep * fc1 * model.hidden_size)
    return largest


@memoised
def _rank_state(model: ModelConfig, layout: Layout, precision: str, rank: int, bucket_numel: Optional[int],
                optimizer: str, overlap_grad_reduce: bool, overlap_param_gather: bool,
                fp8_param_gather: bool) -> tuple:
    """(rank_state_bytes, rank_transient_bytes, --fp8-param-gather's codes and payloads, ZeRO-3's in flight
    included) of pipeline rank `rank`: a search meets each few times."""
    fp8 = fp8_gather_bytes(model, layout, precision, rank, bucket_numel, overlap_param_gather) \
        if fp8_param_gather else None
    return (rank_state_bytes(model, layout, precision, rank, bucket_numel, optimizer=optimizer),
            rank_transient_bytes(model, layout, precision, rank, bucket_numel, overlap_grad_reduce,
                                 overlap_param_gather), 0 if fp8 is None else fp8.codes + fp8.payloads + fp8.transient)


def fp8_held_bytes(model: ModelConfig, layout: Layout, rank: int, microbatches: int, output_layer: bool = False,
                   param_gather: bool = False) -> int:
    """What pipeline rank `rank` keeps of its FP8 weights quantized within a step's schedule of `microbatches`
    (engine.fp8.weights_held): each FP8 linear's codes and their transpose (2 bytes an element), each routed
    expert's codes (1), and under --fp8-output-layer the output layer's on the last stage (2). Nothing with one
    microbatch, or under ZeRO-3, which quantizes at each unit gather. Under --fp8-param-gather the linears and
    experts take the gathered codes (counted by fp8_gather_bytes) and hold none; the output layer's weight is not
    gathered as codes and is held still."""
    if microbatches < 2 or layout.sharding.params:
        return 0

    def elements(experts: bool) -> int:
        return sum(end - start for chunk in rank_chunks(model, layout, rank, experts) for spans in chunk.fp8
                   for start, end in spans)
    held = 0 if param_gather else 2 * elements(False) + (elements(True) if model.num_experts else 0)
    if output_layer and rank == end_ranks(layout)[1]:
        held += 2 * model.padded_vocab_size(layout.tp) // layout.tp * model.hidden_size
    return held


def _logit_bytes(model: ModelConfig, layout: Layout, seq_length: int, fp8_head: Optional[str]) -> float:
    """The last stage's logits (this rank's vocabulary share), the output layer's and again each MTP module's; with
    the output layer in FP8 under recipe `fp8_head`, one head's logits' gradient quantized besides."""
    one = seq_length // layout.cp * layout.micro_batch_size * (model.padded_vocab_size(layout.tp) // layout.tp)
    heads = 1 + (model.mtp_num_layers or 0)
    return LOGIT_BYTES * one * heads + (FP8_LOGIT_GRAD_BYTES[fp8_head] * one if fp8_head else 0)


def memory_per_gpu(model: ModelConfig, layout: Layout, seq_length: int, num_microbatches: int,
                   precision: str = "bf16", flash_attention: bool = True, bucket_numel: Optional[int] = None,
                   overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                   optimizer: str = "adam", fp8_param_gather: bool = False, fp8: Optional[str] = None,
                   fp8_output_layer: bool = False) -> Memory:
    """Peak memory of the pipeline rank that needs the most; weights, gradients and optimizer state (of `optimizer`)
    as the engine allocates them (engine/planner/sharding.py, buckets of `bucket_numel`: the engine's default), and
    the sharding strategies' staging and gathering (--overlap-grad-reduce keeps one more bucket staged under
    ZeRO-2/3, --overlap-param-gather one more unit gathered under ZeRO-3; both off by default, as in the engine).
    `fp8_param_gather`: --fp8-param-gather (tensor-scaled, a sharded optimizer), which keeps the FP8 codes and the
    gathers' payloads besides (ZeRO-3: this rank's payloads, and the units' in flight with their codes). `fp8`
    (the recipe, None without FP8) and `fp8_output_layer`: the FP8 weights held for the step (fp8_held_bytes), and
    the logits' gradient quantized (FP8_LOGIT_GRAD_BYTES)."""
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
    logits = _logit_bytes(model, layout, seq_length, fp8 if fp8_output_layer else None)
    # MTP's layers run once a microbatch on the last stage, with its backward right after (never recomputed)
    mtp = (model.mtp_num_layers or 0) * act("none", model.num_layers - 1 in model.moe_layers())
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
            classes[cls] = (*_rank_state(model, degrees(layout), precision, r, bucket_numel, optimizer,
                                         overlap_grad_reduce, overlap_param_gather, fp8_param_gather),
                            fp8_held_bytes(model, degrees(layout), r, num_microbatches, fp8_output_layer,
                                           fp8_param_gather) if fp8 else 0)
        dense_layers = sum(chunks) - n_moe[r]
        per_chunk = (dense_layers * act_dense + n_moe[r] * act_moe) / len(chunks)
        store_chunk = (dense_layers * store + n_moe[r] * store_moe) / len(chunks)
        acts = in_flight_bytes(layout, r, num_microbatches, per_chunk, store_chunk, costs)
        acts += (workspace if sum(chunks) else 0.0) + (mtp if r == last else 0.0)
        ends = r in (first, last)
        largest = max(largest_layer_weight if sum(chunks) else 0, vocab_shard * model.hidden_size if ends else 0)
        state, (staging, gathered), fp8_gather, held = classes[cls]
        mem = Memory(r, sum(splits[r]), *state, acts, logits if r == last else 0.0, largest * PARAM_BYTES[precision],
                     staging, gathered, fp8_gather, held)
        if best is None or mem.allocated > best.allocated:
            best = mem
    return best

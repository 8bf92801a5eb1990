"""Parameters and memory per GPU for a parallel layout, analytically (no model is built).

Parameters follow the structure engine/model.py builds: embedding [V_pad, h] split over tp (and
learned positions [max_pos, h] replicated), per layer two norms (replicated), fused QKV and fc1
column-parallel, attention output and fc2 row-parallel with their biases replicated, a final norm
and the output layer [V_pad, h] on the last stage (when the embedding is tied and pp > 1, the last
stage holds its own copy of the embedding).

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

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks that hold replicas of the same weights: gradients reduce over them and the distributed
        optimizer shards over them (dp x cp: CP ranks replicate the weights)."""
        return self.dp * self.cp


def stage_layer_counts(num_layers: int, layout: Layout) -> list:
    """Layers per (pipeline rank, model chunk): the engine's own split (engine.pipeline.partition).

    Uneven first/last stages with an interleaved schedule (the engine does not run it; Llama 3 405B did)
    split each rank's layers over its chunks as evenly as they go, for evaluating published layouts."""
    uneven = layout.first_stage_layers is not None or layout.last_stage_layers is not None
    if uneven and layout.vpp > 1:
        per_rank = [len(stage_layers(num_layers, layout.pp, 1, r, 0, layout.first_stage_layers,
                                     layout.last_stage_layers)) for r in range(layout.pp)]
        v = layout.vpp
        return [[n // v + (c < n % v) for c in range(v)] for n in per_rank]
    return [[len(stage_layers(num_layers, layout.pp, layout.vpp, r, c, layout.first_stage_layers,
                              layout.last_stage_layers)) for c in range(layout.vpp)] for r in range(layout.pp)]


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h, d = model.hidden_size, model.head_dim()
    nq, nkv = model.num_attention_heads, model.resolved_query_groups()
    ffn = model.resolved_ffn_hidden_size()
    fc1_out = 2 * ffn if model.swiglu else ffn
    bias = not model.disable_bias_linear
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    qkv = (nq + 2 * nkv) * d * (h + (bias or model.add_qkv_bias)) // tp
    proj = h * nq * d // tp + bias * h
    fc1 = fc1_out * (h + bias) // tp
    fc2 = h * ffn // tp + bias * h
    return 2 * norm + qkv + proj + fc1 + fc2


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


def params_per_rank(model: ModelConfig, layout: Layout) -> list:
    """Parameters held by each pipeline rank (any tensor-parallel rank: they hold equal counts)."""
    counts = stage_layer_counts(model.num_layers, layout)
    per_layer = layer_params(model, layout.tp)
    out = []
    for r, chunks in enumerate(counts):
        n = sum(chunks) * per_layer
        if r == 0:
            n += embedding_params(model, layout.tp)
        if r == layout.pp - 1:
            n += head_params(model, layout.tp, layout.pp)
        out.append(n)
    return out


def layer_activation_bytes(model: ModelConfig, seq_length: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           flash_attention: bool = False, cp: int = 1) -> float:
    """Activation bytes one layer keeps for backward, for one microbatch on one tp rank.

    Under context parallelism a rank holds seq_length/cp tokens of each sequence and saves only its own
    Q, K, V (the ring re-sends the other ranks' K/V in backward), so every term is divided by cp."""
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
    mlp = (6 if model.swiglu else 4) * ffn * s * b
    split = 2 * s * b * (nq * d + nkv * d) + 2 * s * b * nkv * d + 2 * s * b * nq * d + mlp
    # Softmax output (2), its dropout mask (1) and dropout output (2) per score.
    scores = 0 if (flash_attention or recompute == "selective") else 5 * nq * s * s * cp * b
    return replicated / sp + (split + scores) / tp


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


def state_bytes(params: int, layout: Layout, precision: str) -> tuple:
    """(weights, gradients, optimizer state) bytes for `params` parameters on one GPU."""
    shard = layout.shard_group if layout.distributed_optimizer else 1
    master = MASTER_BYTES if (precision != "fp32" or layout.distributed_optimizer) else 0
    return (params * PARAM_BYTES[precision], params * GRAD_BYTES,
            params * (ADAM_MOMENT_BYTES + master) / shard)


def memory_per_gpu(model: ModelConfig, layout: Layout, seq_length: int, num_microbatches: int,
                   precision: str = "bf16", flash_attention: bool = True) -> Memory:
    """Peak memory of the pipeline rank that needs the most."""
    counts = stage_layer_counts(model.num_layers, layout)
    params = params_per_rank(model, layout)
    act_layer = layer_activation_bytes(model, seq_length, layout.micro_batch_size, layout.tp,
                                       layout.sequence_parallel, layout.recompute, flash_attention, layout.cp)
    # Full recomputation rebuilds one layer's complete activations during its backward pass.
    workspace = 0.0
    if layout.recompute == "full":
        workspace = layer_activation_bytes(model, seq_length, layout.micro_batch_size, layout.tp,
                                           layout.sequence_parallel, "none", flash_attention, layout.cp)
    vocab_shard = model.padded_vocab_size(layout.tp) // layout.tp
    logits = LOGIT_BYTES * seq_length // layout.cp * layout.micro_batch_size * vocab_shard
    ffn = model.resolved_ffn_hidden_size() * (2 if model.swiglu else 1)
    largest_layer_weight = max(ffn, (model.num_attention_heads + 2 * model.resolved_query_groups())
                               * model.head_dim()) * model.hidden_size // layout.tp
    best = None
    for r, chunks in enumerate(counts):
        layers_per_chunk = sum(chunks) / len(chunks)
        acts = peak_in_flight(layout.pp, layout.vpp, r, num_microbatches) * layers_per_chunk * act_layer
        acts += workspace if sum(chunks) else 0.0
        ends = r == 0 or r == layout.pp - 1
        largest = max(largest_layer_weight if sum(chunks) else 0, vocab_shard * model.hidden_size if ends else 0)
        mem = Memory(r, params[r], *state_bytes(params[r], layout, precision), acts,
                     logits if r == layout.pp - 1 else 0.0, largest * PARAM_BYTES[precision])
        if best is None or mem.allocated > best.allocated:
            best = mem
    return best

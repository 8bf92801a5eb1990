"""Step time of a parallel layout, and the search over layouts that ranks them.

One training iteration on a pipeline is modelled as (Narayanan et al. 2021, sec. 2.2 and 3):

    step = (m + (p - 1)/v) · T_stage  +  exposed data-parallel reduction  +  optimizer step

with m microbatches per pipeline, T_stage the forward+backward time of one microbatch on the slowest
pipeline rank, and (p - 1)/v the pipeline bubble of 1F1B (v = 1) or the interleaved schedule.
T_stage sums, per layer: the matrix multiplies at a fraction of peak that grows with the per-GPU
matrix sizes, the attention core, memory-bound element-wise work, and the tensor-parallel
collectives over NVLink; plus the pipeline point-to-point sends over the network, the embedding and
the output layer. Every constant is named below with where it comes from; the ones marked "fitted"
were fitted to the held-in published runs listed in tests/test_find_parallelism.py. Compute is
costed at the tensor-core (bf16) peak whatever the precision; fp32 changes only the bytes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

from engine.config import ModelConfig
from engine.planner.flops import GPUSpec, flops_per_iteration
from engine.planner.memory import (
    GIB,
    GRAD_BYTES,
    PARAM_BYTES,
    Layout,
    Memory,
    layer_activation_bytes,
    memory_per_gpu,
    params_per_rank,
    stage_layer_counts,
)

# Fraction of the dense peak the layer GEMMs of a training step reach, large-shape limit. A100:
# fitted (0.74; it folds in launch gaps and small kernels the model does not list). Hopper and
# Blackwell reach a smaller fraction of their higher peaks (cuBLAS on large bf16 shapes, roughly: 85%
# of peak on A100, 75% on H100, 70% on B200), so their values are the A100 fit scaled by those ratios;
# no published Hopper/Blackwell run is in the tests, so treat those as estimates.
GEMM_EFFICIENCY = {"a100-40g": 0.74, "a100-80g": 0.74, "h100-sxm": 0.65, "h100-pcie": 0.65,
                   "h200": 0.65, "b200": 0.61}
GEMM_EFFICIENCY_DEFAULT = 0.65
# Each GEMM dimension x costs a factor x/(x + GEMM_HALF_DIM): small dimensions leave tensor cores
# idle (tile quantisation, wave effects). Fitted.
GEMM_HALF_DIM = 64.0
# Flash attention's attention-core throughput as a fraction of the dense peak (FlashAttention-2
# paper: 50-73% of A100 peak forward), and its backward-to-forward time ratio (5 matmuls vs 2).
FLASH_ATTENTION_EFFICIENCY = 0.5
FLASH_BACKWARD_RATIO = 2.5
# Unfused attention (Megatron-LM 2021-22): scaled-masked softmax reads and writes the scores, then
# dropout reads them and writes output and a 1-byte mask: 2+2+2+2+1 bytes per score forward.
UNFUSED_SCORE_TRAFFIC = 9
# Element-wise work (norms, bias, activation, dropout, residual adds, rotary) moves about twice the
# bytes it stores for backward (each saved tensor is written once and read once); backward twice that.
# (2 was also the best of 1-3 when fitting the two constants above.)
ELEMENTWISE_TRAFFIC = 2.0
# Bytes moved per logit by the loss, forward and backward: the max/sum-exp pass and the gradient pass
# read the 2-byte logits, the gradient is written, the output GEMMs' epilogues and fp32 temporaries.
CROSS_ENTROPY_TRAFFIC = 20
HBM_EFFICIENCY = 0.8          # achievable fraction of HBM bandwidth for streaming kernels (STREAM-like)
# NCCL bus bandwidth as a fraction of the link's (nccl-tests on DGX A100/H100: ~230 of 300 GB/s
# NVLink, ~ 20-22 of 25 GB/s per HDR NIC), and per-collective latency.
NVLINK_EFFICIENCY = 0.77
NETWORK_EFFICIENCY = 0.85
NVLINK_LATENCY_S = 15e-6
NETWORK_LATENCY_S = 30e-6
# With overlap, gradient reduction hides behind the last microbatch's backward pass except for the
# last bucket (Megatron-LM default buckets of 40M parameters: a few % of a large stage).
LAST_BUCKET_FRACTION = 0.05
# Adam step bytes per parameter of the (sharded) state: read+write fp32 master, m, v (24), read the
# fp32 gradient (4), write the 2-byte weight (2).
OPTIMIZER_STEP_BYTES = 30
# Search limits: micro batch sizes tried (powers of two up to this) and virtual stages per rank.
MAX_MICRO_BATCH = 16
MAX_VPP = 8


@dataclass(frozen=True)
class Software:
    """Engine features that change the cost but not the layout."""
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    precision: str = "bf16"
    grad_reduce_bytes: int = GRAD_BYTES   # fp32 main gradients; fp16 runs of 2021 reduced 2-byte grads


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    fits: bool
    step_time_s: float
    breakdown: dict
    tokens_per_s: float
    tflops_per_gpu: float      # model FLOPs (no recomputation): what MFU is computed from
    hw_tflops_per_gpu: float   # including recomputed forward work
    mfu: float

    def to_dict(self) -> dict:
        d = asdict(self.layout)
        d.update(
            memory_gb_per_gpu=round(self.memory.total / GIB, 2),
            allocated_gb=round(self.memory.allocated / GIB, 2),
            memory_breakdown_gb={k: round(getattr(self.memory, k) / GIB, 2)
                                 for k in ("weights", "grads", "optimizer", "activations", "logits", "transient")},
            params_most_loaded_rank=self.memory.params, fits=self.fits,
            step_time_s=round(self.step_time_s, 4), tokens_per_s=round(self.tokens_per_s, 1),
            tflops_per_gpu=round(self.tflops_per_gpu, 1), hw_tflops_per_gpu=round(self.hw_tflops_per_gpu, 1),
            mfu=round(self.mfu, 4), time_breakdown_s={k: round(v, 4) for k, v in self.breakdown.items()})
        return d


@dataclass
class _Link:
    gbps: float
    efficiency: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return nbytes / (self.gbps / 8 * 1e9 * self.efficiency) + self.latency


def _all_reduce(nbytes: float, n: int, link: _Link) -> float:
    """Ring all-reduce (or reduce-scatter + all-gather) of nbytes over n ranks."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * (link.seconds(nbytes) - link.latency) + 2 * link.latency


def gemm_seconds(m: float, n: float, k: float, gpu: GPUSpec) -> float:
    eff = GEMM_EFFICIENCY.get(gpu.name, GEMM_EFFICIENCY_DEFAULT)
    for x in (m, n, k):
        eff *= x / (x + GEMM_HALF_DIM)
    return 2 * m * n * k / (gpu.peak_tflops * 1e12 * eff)


@dataclass
class _Costs:
    """Per-microbatch seconds for one layer, the embedding and the output layer, on one GPU."""
    layer_fwd: float
    layer_bwd: float
    layer_recompute: float
    embed: float
    head: float
    p2p: float


def _costs(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software,
           nvlink: _Link, pp_link: _Link) -> _Costs:
    t, b, s, h = layout.tp, layout.micro_batch_size, seq, model.hidden_size
    d, nq, nkv = model.head_dim(), model.num_attention_heads, model.resolved_query_groups()
    ffn = model.resolved_ffn_hidden_size()
    tokens = b * s
    gemm = (gemm_seconds(tokens, (nq + 2 * nkv) * d / t, h, gpu) + gemm_seconds(tokens, h, nq * d / t, gpu)
            + gemm_seconds(tokens, (2 if model.swiglu else 1) * ffn / t, h, gpu)
            + gemm_seconds(tokens, h, ffn / t, gpu))
    heads = nq / t
    if sw.flash_attention:
        attn_fwd = 4 * b * s * s * heads * d / (gpu.peak_tflops * 1e12 * FLASH_ATTENTION_EFFICIENCY)
        attn_bwd = FLASH_BACKWARD_RATIO * attn_fwd
    else:
        per_head = gemm_seconds(s, s, d, gpu) + gemm_seconds(s, d, s, gpu)
        softmax = UNFUSED_SCORE_TRAFFIC * heads * b * s * s / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
        attn_fwd = b * heads * per_head + softmax
        attn_bwd = 2 * attn_fwd
    stored = layer_activation_bytes(model, s, b, t, layout.sequence_parallel, "none", flash_attention=True)
    elementwise = ELEMENTWISE_TRAFFIC * stored / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    tp_comm = 2 * _all_reduce(2 * tokens * h, t, nvlink)
    fwd = gemm + attn_fwd + elementwise + tp_comm
    bwd = 2 * gemm + attn_bwd + 2 * elementwise + tp_comm
    recompute = {"full": fwd, "selective": attn_fwd}.get(layout.recompute, 0.0)
    vocab = model.padded_vocab_size(t)
    logits_traffic = CROSS_ENTROPY_TRAFFIC * tokens * vocab / t / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    head = 3 * gemm_seconds(tokens, vocab / t, h, gpu) + logits_traffic + 2 * _all_reduce(2 * tokens * h, t, nvlink)
    embed = 2 * _all_reduce(2 * tokens * h, t, nvlink)
    # Megatron's scatter-gather optimisation (or sequence parallelism) sends 1/t of the activations.
    p2p = pp_link.seconds(2 * tokens * h / t) if layout.pp > 1 else 0.0
    return _Costs(fwd, bwd, recompute, embed, head, p2p)


def _links(layout: Layout, gpu: GPUSpec, gpus_per_node: int) -> tuple:
    nvlink = _Link(gpu.nvlink_gbps, NVLINK_EFFICIENCY, NVLINK_LATENCY_S)
    net = _Link(gpu.network_gbps, NETWORK_EFFICIENCY, NETWORK_LATENCY_S)
    # Rank order is tp fastest, then dp, then pp: a dp group stays in a node while tp·dp fits in it,
    # and neighbouring pipeline stages are tp·dp ranks apart.
    inside = layout.tp * layout.dp <= gpus_per_node
    return nvlink, (nvlink if inside else net), (nvlink if inside else net)


def estimate(model: ModelConfig, layout: Layout, gpu: GPUSpec, global_batch: int, seq: int,
             gpus_per_node: int = 8, software: Software = Software()) -> Estimate:
    """Memory and step time of one layout (which must be valid: see candidate_layouts)."""
    m = global_batch // (layout.dp * layout.micro_batch_size)
    nvlink, dp_link, pp_link = _links(layout, gpu, gpus_per_node)
    c = _costs(model, layout, seq, gpu, software, nvlink, pp_link)
    counts = stage_layer_counts(model.num_layers, layout)
    layer = c.layer_fwd + c.layer_bwd + c.layer_recompute
    stage_times, stage_bwd = [], []
    for r, chunks in enumerate(counts):
        n = sum(chunks)
        time = n * layer + 2 * len(chunks) * c.p2p
        time += c.embed if r == 0 else 0.0
        time += c.head if r == layout.pp - 1 else 0.0
        stage_times.append(time)
        stage_bwd.append(n * (c.layer_bwd + c.layer_recompute))
    slowest = max(range(layout.pp), key=lambda r: stage_times[r])
    t_stage = stage_times[slowest]
    compute = m * t_stage
    bubble = (layout.pp - 1) / layout.vpp * t_stage

    params = params_per_rank(model, layout)[slowest]
    n_dp = layout.dp
    grad_reduce = _all_reduce(software.grad_reduce_bytes * params, n_dp, dp_link)
    param_gather = 0.0
    if layout.distributed_optimizer:
        grad_reduce /= 2  # reduce-scatter only
        param_gather = _all_reduce(PARAM_BYTES[software.precision] * params, n_dp, dp_link) / 2
    if software.overlap_grad_reduce:
        grad_reduce = max(grad_reduce - stage_bwd[slowest], LAST_BUCKET_FRACTION * grad_reduce)
    opt_params = params / n_dp if layout.distributed_optimizer else params
    optimizer = OPTIMIZER_STEP_BYTES * opt_params / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    step = compute + bubble + grad_reduce + param_gather + optimizer

    mem = memory_per_gpu(model, layout, seq, m, software.precision, software.flash_attention)
    n_gpus = layout.num_gpus
    model_flops = flops_per_iteration(model, global_batch, seq, None, layout.tp)
    hw_flops = flops_per_iteration(model, global_batch, seq,
                                   None if layout.recompute == "none" else layout.recompute, layout.tp)
    breakdown = dict(compute=compute, bubble=bubble, dp_comm=grad_reduce + param_gather, optimizer=optimizer,
                     tp_comm_per_layer=2 * _all_reduce(2 * layout.micro_batch_size * seq * model.hidden_size,
                                                       layout.tp, nvlink))
    return Estimate(layout, mem, mem.total <= gpu.memory_gib * GIB, step, breakdown,
                    global_batch * seq / step, model_flops / step / n_gpus / 1e12,
                    hw_flops / step / n_gpus / 1e12, model_flops / step / n_gpus / 1e12 / gpu.peak_tflops)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_split(num_layers: int, pp: int) -> Optional[tuple]:
    """(first, last) stage layers when pp does not divide the layers: middle stages get
    ceil(L/pp) each, the first and last share the rest (fewer layers where embedding and output sit)."""
    if pp < 2 or num_layers < pp:
        return None
    if pp == 2:
        return num_layers - num_layers // 2, num_layers // 2
    per = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per
    if rest < 2:
        per = (num_layers - 2) // (pp - 2)
        rest = num_layers - (pp - 2) * per
    if per < 1 or rest < 2 or (num_layers - rest) != (pp - 2) * per:
        return None
    return rest - rest // 2, rest // 2


def candidate_layouts(model: ModelConfig, num_gpus: int, gpus_per_node: int, global_batch: int,
                      seq: int) -> Iterator[Layout]:
    """Every valid layout: tp inside a node dividing heads, query groups and the MLP width; pp
    dividing the layers (or an uneven split); vpp for even splits; micro batches dividing the batch."""
    nq, nkv, ffn, L = (model.num_attention_heads, model.resolved_query_groups(),
                       model.resolved_ffn_hidden_size(), model.num_layers)
    for tp in _divisors(min(gpus_per_node, num_gpus)):
        if gpus_per_node % tp or nq % tp or nkv % tp or ffn % tp or num_gpus % tp:
            continue
        for pp in _divisors(num_gpus // tp):
            if pp > L:
                continue
            dp = num_gpus // (tp * pp)
            if global_batch % dp:
                continue
            split = None if L % pp == 0 else uneven_split(L, pp)
            if L % pp and split is None:
                continue
            per_dp = global_batch // dp
            for mb in (x for x in (2 ** i for i in range(MAX_MICRO_BATCH.bit_length())) if per_dp % x == 0):
                m = per_dp // mb
                vpps = [1]
                if split is None and pp > 1 and m % pp == 0:
                    vpps += [v for v in _divisors(L // pp) if 1 < v <= MAX_VPP]
                for vpp in vpps:
                    for recompute in ("none", "selective", "full"):
                        for sp in ((False, True) if tp > 1 and seq % tp == 0 else (False,)):
                            for dist in ((False, True) if dp > 1 else (False,)):
                                yield Layout(tp, pp, dp, vpp, mb, recompute, sp, dist,
                                             split[0] if split else None, split[1] if split else None)


def rank_layouts(model: ModelConfig, num_gpus: int, gpu: GPUSpec, global_batch: int, seq: int,
                 gpus_per_node: int = 8, software: Software = Software()) -> list:
    """All candidate layouts, fastest first; layouts that do not fit come after those that do."""
    out = [estimate(model, lay, gpu, global_batch, seq, gpus_per_node, software)
           for lay in candidate_layouts(model, num_gpus, gpus_per_node, global_batch, seq)]
    out.sort(key=lambda e: (not e.fits, round(e.step_time_s, 6), e.memory.total))
    return out


def chinchilla_optimal(compute_flops: float) -> tuple:
    """(parameters, tokens) minimising loss for a FLOP budget: Hoffmann et al. 2022 find tokens ≈ 20 x
    parameters at the optimum; with C = 6·N·D that is N = sqrt(C/120), D = 20·N."""
    n = math.sqrt(compute_flops / 120.0)
    return n, 20.0 * n

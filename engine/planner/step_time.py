"""Step time of a parallel layout (the search over layouts is engine/planner/search.py).

One training iteration on a pipeline is modelled as (Narayanan et al. 2021, sec. 2.2 and 3):

    step = (m + (p - 1)/v) · T_stage  +  exposed data-parallel reduction  +  optimizer step

with m microbatches per pipeline, T_stage the forward+backward time of one microbatch on the slowest
pipeline rank, and (p - 1)/v the pipeline bubble of 1F1B (v = 1) or the interleaved schedule; the
zero-bubble schedules (Layout.pipeline_schedule zb-h1, zb-v) take theirs from the schedule simulator
(engine.pipeline.schedules.bubble_time): the order the engine runs, built for the model's FLOPs split of the
backward into input and weight gradients (engine.flops.split_backward_costs), replayed at the stage's times.
T_stage sums, per layer: the matrix multiplies at a fraction of peak that grows with the per-GPU
matrix sizes (and differs by GPU generation), the attention core, memory-bound element-wise work, the
tensor-parallel collectives over NVLink (less the share a TP-overlapping engine hides), and with
context parallelism the part of the K/V exchange the attention does not hide; plus the pipeline
point-to-point sends, the embedding and the output layer. Under cp every rank holds s/cp tokens of each
sequence. Each group's collectives run over NVLink when the group fits in a node, else over the
network at the bandwidth of the NICs its members in a node bring (rank order tp, cp, dp, pp). Every
constant is named below with where it comes from; the ones marked "fitted" were fitted to the held-in
published runs of engine/planner/published.py (listed with their errors in tests/test_find_parallelism.py).
Compute is costed at the tensor-core (bf16) peak whatever the precision; fp32 changes only the bytes.

Mixture of experts: an MoE layer replaces the MLP GEMMs by its router (fp32), its shared expert (a
tensor-parallel MLP) and its routed experts. Routing is taken as balanced: of the k x T assignments each
of the ep ranks of an EP group makes (T tokens per rank: s/(cp·tp) x b under sequence parallelism), every
expert gets k·T·ep/E rows, so a rank runs E/ep GEMMs of that many rows (smaller GEMMs lose efficiency
through GEMM_HALF_DIM). Dispatch and combine are one all-to-all each of k·T·h activations per rank
forward, the same again backward, not overlapped (the engine does not); the EP group is ep ranks at
stride tp·cp, over NVLink when the tp·cp·ep ranks fit in a node, else the part leaving the node goes
through each GPU's own NIC. Expert gradients reduce over their dp/ep x cp replicas.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from engine.attention_mask import AttentionMask
from engine.config import ModelConfig
from engine.flops import Costs
from engine.flops import GPUSpec, flops_per_iteration, split_backward_costs
from engine.layout import Layout
from engine.pipeline.schedules import bubble_time
from engine.planner.memory import (
    GIB,
    GRAD_BYTES,
    PARAM_BYTES,
    Memory,
    end_ranks,
    layer_activation_bytes,
    memory_per_gpu,
    moe_layers_per_rank,
    param_split_per_rank,
    stage_layer_counts,
)

# Fraction of the dense peak the layer GEMMs of a training step reach, large-shape limit. A100: fitted
# (0.74; it folds in launch gaps and small kernels the model does not list) on Narayanan et al. 2021's
# Table 1. H100: fitted (0.66) on the held-in H100 runs of engine/planner/published.py (llm-foundry, Llama 3
# 405B on 8,192 GPUs); H200 has the same GH100 compute. B200: the A100 fit scaled by the ratio of
# cuBLAS large-shape bf16 efficiencies (~70% of peak vs ~85%); no published B200 run is checked.
GEMM_EFFICIENCY = {"a100-40g": 0.74, "a100-80g": 0.74, "h100-sxm": 0.66, "h100-pcie": 0.66,
                   "h200": 0.66, "b200": 0.61}
GEMM_EFFICIENCY_DEFAULT = 0.65
# Each GEMM dimension x costs a factor x/(x + GEMM_HALF_DIM): small dimensions leave tensor cores
# idle (tile quantisation, wave effects). Fitted.
GEMM_HALF_DIM = 64.0
# Flash attention's attention-core throughput as a fraction of the dense peak, in the FLOPs this planner
# counts (the full s x s scores: a causal kernel skips half of them, so these can exceed what the
# kernel's own counter reports), and its backward-to-forward time ratio (5 matmuls vs 2).
# A100: FlashAttention-2 paper (Dao 2023), 50-73% of peak forward. H100: fitted (see below).
FLASH_ATTENTION_EFFICIENCY = {"a100-40g": 0.5, "a100-80g": 0.5, "h100-sxm": 0.5, "h100-pcie": 0.5,
                              "h200": 0.5, "b200": 0.5}
FLASH_ATTENTION_DEFAULT = 0.5
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
# FSDP (parameters sharded and re-gathered for every microbatch): the fraction of its collectives that
# overlap hides. Fitted on the held-in llm-foundry H100 runs (PyTorch 2.0-era FSDP keeps the NCCL kernels
# and the GEMMs competing for the same SMs, and prefetches one layer ahead: little of it is hidden).
FSDP_HIDDEN_FRACTION = 0.3
# The MoE router runs in fp32 (engine/moe/router.py) on CUDA cores, not tensor cores: their fp32 peak is
# 1/16 (A100: 19.5 of 312 TFLOP/s) to 1/15 (H100 SXM: 67 of 989) of the dense bf16 peak (NVIDIA data sheets).
FP32_SLOWDOWN = 15.0
# Adam step bytes per parameter of the (sharded) state: read+write fp32 master, m, v (24), read the
# fp32 gradient (4), write the 2-byte weight (2).
OPTIMIZER_STEP_BYTES = 30


@dataclass(frozen=True)
class Software:
    """Engine features that change the cost but not the layout.

    tp_comm_overlap: fraction of the tensor-parallel collectives hidden behind GEMMs (Megatron-Core's
    --tp-comm-overlap; this engine does not overlap them: 0). attention_efficiency: the flash-attention kernel's throughput as a fraction of peak when
    it differs from the GPU's default (FLASH_ATTENTION_EFFICIENCY), e.g. an older kernel.
    """
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    precision: str = "bf16"
    grad_reduce_bytes: int = GRAD_BYTES   # fp32 main gradients; fp16 runs of 2021 reduced 2-byte grads
    tp_comm_overlap: float = 0.0
    cp_comm_type: str = "p2p"             # p2p: K/V ring overlapped with attention; all_gather: gathered first
    attention_efficiency: Optional[float] = None


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
    cp_comm: float      # exposed K/V ring (or all-gather) time per layer, forward + backward
    moe_fwd: float = 0.0        # an MoE layer's forward, backward and recomputed seconds (all-to-all included)
    moe_bwd: float = 0.0
    moe_recompute: float = 0.0
    moe_a2a: float = 0.0        # of which all-to-all, forward + backward


@dataclass
class _Links:
    """The link each group's collectives run over (rank order tp, cp, dp, pp: Megatron's)."""
    tp: _Link
    cp: _Link
    dp: _Link
    pp: _Link
    edp: Optional[_Link] = None     # the experts' replicas (dp/ep x cp ranks, stride tp·ep)
    ep_in_node: int = 1             # EP group members in one node (the all-to-all's NVLink share)
    network: Optional[_Link] = None  # one GPU's NIC


def _links(layout: Layout, gpu: GPUSpec, gpus_per_node: int, cp_collective: bool = False) -> _Links:
    """A CP group is tp*cp consecutive ranks (stride tp), a dp x cp group tp*cp*dp; pipeline neighbours are
    tp*cp*dp ranks apart, so they share a node only when the whole job does. A ring collective whose group
    has k members in each node runs k rings side by side (NCCL channels), one per member's NIC, so across
    nodes it moves k x one NIC's bandwidth (capped by NVLink); a point-to-point ring step (the CP K/V
    exchange) crosses a node boundary through one NIC."""
    nvlink = _Link(gpu.nvlink_gbps, NVLINK_EFFICIENCY, NVLINK_LATENCY_S)

    def group(span: int, stride: int, collective: bool) -> _Link:
        if span <= gpus_per_node:
            return nvlink
        per_node = max(1, gpus_per_node // stride) if collective else 1
        return _Link(min(gpu.nvlink_gbps, per_node * gpu.network_gbps), NETWORK_EFFICIENCY, NETWORK_LATENCY_S)

    tp, cp, ep = layout.tp, layout.cp, layout.ep
    ep_in_node = ep if tp * cp * ep <= gpus_per_node else max(1, gpus_per_node // (tp * cp))
    return _Links(nvlink, group(tp * cp, tp, cp_collective), group(tp * cp * layout.dp, tp, True),
                  group(layout.num_gpus, tp * cp * layout.dp, False), group(tp * cp * layout.dp, tp * ep, True),
                  ep_in_node, _Link(gpu.network_gbps, NETWORK_EFFICIENCY, NETWORK_LATENCY_S))


def _all_to_all(nbytes: float, ep: int, links: _Links) -> float:
    """An all-to-all over the EP group in which every rank holds nbytes, 1/ep of it for each member: the
    share for members in the node goes over NVLink while the rest leaves through the GPU's own NIC."""
    if ep == 1:
        return 0.0
    inside = nbytes * (links.ep_in_node - 1) / ep
    outside = nbytes * (ep - links.ep_in_node) / ep
    return max(links.tp.seconds(inside), links.network.seconds(outside) if outside else 0.0)


def _attention_seconds(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software) -> tuple:
    """(forward, backward) seconds of one layer's attention core for one microbatch on one GPU. Under cp
    each rank computes 1/cp of the (load-balanced) score blocks."""
    b, t, cp = layout.micro_batch_size, layout.tp, layout.cp
    d, heads = model.head_dim(), model.num_attention_heads / t
    keys = AttentionMask.of(model).keys_per_query(seq)
    if sw.flash_attention:
        eff = sw.attention_efficiency or FLASH_ATTENTION_EFFICIENCY.get(gpu.name, FLASH_ATTENTION_DEFAULT)
        fwd = 4 * b * seq * keys * heads * d / cp / (gpu.peak_tflops * 1e12 * eff)
        return fwd, FLASH_BACKWARD_RATIO * fwd
    s_local = seq / cp
    per_head = gemm_seconds(s_local, keys, d, gpu) + gemm_seconds(s_local, d, keys, gpu)
    softmax = UNFUSED_SCORE_TRAFFIC * heads * b * s_local * keys / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    fwd = b * heads * per_head + softmax
    return fwd, 2 * fwd


def _cp_comm(model: ModelConfig, layout: Layout, seq: int, sw: Software, link: _Link, attn: tuple) -> float:
    """Exposed seconds of the K/V exchange of one layer, forward and backward. Forward: every rank sends
    cp - 1 blocks of K and V ((s/cp) b (groups/tp) d elements each); backward sends K/V again plus their
    gradients (2x). The ring overlaps each step's transfer with the attention of the block in hand;
    all_gather gathers K/V before attention (Llama 3's choice), so nothing hides it."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    block = 2 * (seq / cp) * layout.micro_batch_size * model.resolved_query_groups() / layout.tp * model.head_dim()
    fwd = (cp - 1) * (link.seconds(2 * block) - link.latency) + (cp - 1) * link.latency
    bwd = 2 * fwd
    if sw.cp_comm_type == "all_gather":
        return fwd + bwd
    return max(0.0, fwd - attn[0]) + max(0.0, bwd - attn[1])


def _costs(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software, links: _Links) -> _Costs:
    t, h = layout.tp, model.hidden_size
    d, nq, nkv = model.head_dim(), model.num_attention_heads, model.resolved_query_groups()
    ffn = model.resolved_ffn_hidden_size()
    tokens = layout.micro_batch_size * seq / layout.cp  # this rank's share of the microbatch
    attn_gemm = gemm_seconds(tokens, (nq + 2 * nkv) * d / t, h, gpu) + gemm_seconds(tokens, h, nq * d / t, gpu)
    gemm = attn_gemm + _mlp_gemm(model, tokens, ffn / t, gpu)
    attn_fwd, attn_bwd = _attention_seconds(model, layout, seq, gpu, sw)
    stored = layer_activation_bytes(model, seq, layout.micro_batch_size, t, layout.sequence_parallel, "none",
                                    flash_attention=True, cp=layout.cp)
    elementwise = ELEMENTWISE_TRAFFIC * stored / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    tp_comm = 2 * _all_reduce(2 * tokens * h, t, links.tp) * (1 - sw.tp_comm_overlap)
    fwd = gemm + attn_fwd + elementwise + tp_comm
    bwd = 2 * gemm + attn_bwd + 2 * elementwise + tp_comm
    recompute = {"full": fwd, "selective": attn_fwd}.get(layout.recompute, 0.0)
    vocab = model.padded_vocab_size(t)
    logits_traffic = CROSS_ENTROPY_TRAFFIC * tokens * vocab / t / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    head = 3 * gemm_seconds(tokens, vocab / t, h, gpu) + logits_traffic + 2 * _all_reduce(2 * tokens * h, t, links.tp)
    embed = 2 * _all_reduce(2 * tokens * h, t, links.tp)
    # Megatron's scatter-gather optimisation (or sequence parallelism) sends 1/t of the activations.
    p2p = links.pp.seconds(2 * tokens * h / t) if layout.pp > 1 else 0.0
    cp_comm = _cp_comm(model, layout, seq, sw, links.cp, (attn_fwd, attn_bwd))
    moe = _moe_layer(model, layout, seq, gpu, sw, links, (attn_gemm, attn_fwd, attn_bwd)) if model.num_experts else ()
    return _Costs(fwd, bwd, recompute, embed, head, p2p, cp_comm, *moe)


def _mlp_gemm(model: ModelConfig, rows: float, ffn: float, gpu: GPUSpec) -> float:
    """Forward seconds of an MLP of width ffn (this rank's share) over `rows` tokens: fc1 and fc2."""
    if rows == 0 or ffn == 0:
        return 0.0
    h = model.hidden_size
    return gemm_seconds(rows, (2 if model.swiglu else 1) * ffn, h, gpu) + gemm_seconds(rows, h, ffn, gpu)


def _moe_layer(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software, links: _Links,
               attn: tuple) -> tuple:
    """(forward, backward, recomputed, all-to-all) seconds of one MoE layer for one microbatch on one GPU.
    attn: the layer's attention GEMMs and its attention core forward and backward (as in a dense layer)."""
    attn_gemm, attn_fwd, attn_bwd = attn
    t, h, E, k, ep = layout.tp, model.hidden_size, model.num_experts, model.moe_router_topk, layout.ep
    tokens = layout.micro_batch_size * seq / layout.cp
    routed = tokens / (t if layout.sequence_parallel else 1)  # each tp rank routes its own tokens under SP
    rows = k * routed * ep / E  # per expert, balanced routing over the EP group
    experts = E / ep * _mlp_gemm(model, rows, model.resolved_moe_ffn_hidden_size(), gpu)
    shared = _mlp_gemm(model, tokens, (model.moe_shared_expert_intermediate_size or 0) / t, gpu)
    router = FP32_SLOWDOWN * gemm_seconds(routed, E, h, gpu)
    gemm = attn_gemm + experts + shared + router
    stored = layer_activation_bytes(model, seq, layout.micro_batch_size, t, layout.sequence_parallel, "none",
                                    flash_attention=True, cp=layout.cp, moe=True)
    elementwise = ELEMENTWISE_TRAFFIC * stored / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    # The attention's TP collectives, and the shared expert's; the routed experts need none (tokens stay put).
    n_tp = 1 + bool(model.moe_shared_expert_intermediate_size)
    tp_comm = n_tp * _all_reduce(2 * tokens * h, t, links.tp) * (1 - sw.tp_comm_overlap)
    a2a = 2 * _all_to_all(2 * k * routed * h, ep, links)  # dispatch and combine, bf16 activations
    fwd = gemm + attn_fwd + elementwise + tp_comm + a2a
    bwd = 2 * gemm + attn_bwd + 2 * elementwise + tp_comm + a2a
    recompute = {"full": fwd, "selective": attn_fwd}.get(layout.recompute, 0.0)
    return fwd, bwd, recompute, 2 * a2a


def _stage_times(model: ModelConfig, layout: Layout, c: _Costs) -> tuple:
    """(forward+backward seconds of one microbatch on each pipeline rank, backward seconds of each); ZB-V's V
    puts the output layer on rank 0, beside the embedding (memory.end_ranks)."""
    embed_rank, head_rank = end_ranks(layout)
    layer = c.layer_fwd + c.layer_bwd + c.layer_recompute + c.cp_comm
    moe_layer = c.moe_fwd + c.moe_bwd + c.moe_recompute + c.cp_comm
    n_moe = moe_layers_per_rank(model, layout) if model.num_experts else None
    times, bwd, seen = [], [], {}
    for r, chunks in enumerate(stage_layer_counts(model.num_layers, layout)):
        k = (sum(chunks), len(chunks), n_moe[r] if n_moe else 0, r == embed_rank, r == head_rank)
        if k not in seen:  # ranks alike cost alike: most of a deep pipeline is its middle stages
            n, moe = k[0] - k[2], k[2]
            seen[k] = (n * layer + moe * moe_layer + 2 * k[1] * c.p2p + (c.embed if k[3] else 0.0)
                       + (c.head if k[4] else 0.0),
                       n * (c.layer_bwd + c.layer_recompute) + moe * (c.moe_bwd + c.moe_recompute))
        times.append(seen[k][0])
        bwd.append(seen[k][1])
    return times, bwd


def _bubble(layout: Layout, m: int, t_stage: float, t_backward: float, costs: Costs) -> float:
    """Idle pipeline seconds per step: (p - 1)/v stage times for 1F1B and interleaving; for a zero-bubble
    schedule the simulated bubble of the order the engine runs (built for the model's FLOPs split, `costs`),
    replayed with the stage's backward seconds split into B and W in the proportion of those costs."""
    if not layout.schedule.split_backward:
        return (layout.pp - 1) / layout.vpp * t_stage
    # Simulated in units of the forward time, B and W at two significant digits of it (the simulations are
    # cached: a search meets few distinct ratios).
    t_forward = t_stage - t_backward
    weight = t_backward * costs.weight_grad / (costs.input_grad + costs.weight_grad)
    b, w = (float(f"{x / t_forward:.2g}") for x in (t_backward - weight, weight))
    return t_forward * bubble_time(layout.schedule, m, 1.0, b, w, costs)


def _data_parallel_seconds(params: int, layout: Layout, gpu: GPUSpec, sw: Software, link: _Link,
                           micro: tuple, m: int, experts: int = 0, expert_link: Optional[_Link] = None) -> dict:
    """Exposed gradient reduction and parameter gathering over the dp x cp replicas (and the `experts`
    parameters' over their dp/ep x cp replicas, on expert_link), and the Adam step.
    micro: (forward, backward) seconds of one microbatch on the slowest stage; m: microbatches."""
    groups = [(params, layout.shard_group, link)]
    if experts:
        groups.append((experts, layout.expert_shard_group, expert_link or link))
    sharding = layout.sharding
    grad = sum(_all_reduce(sw.grad_reduce_bytes * p, n, lk) for p, n, lk in groups)
    gather = 0.0
    if sharding.optimizer:
        grad /= 2  # reduce-scatter only
        gather = sum(_all_reduce(PARAM_BYTES[sw.precision] * p, n, lk) for p, n, lk in groups) / 2
    sharded = sum(p / n for p, n, _ in groups)
    hbm = gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY
    if sharding.params:  # gathered for every microbatch's forward and backward, grads scattered
        per_micro = (2 * gather + grad) * (1 - FSDP_HIDDEN_FRACTION)
        return dict(dp_comm=m * per_micro, optimizer=OPTIMIZER_STEP_BYTES * sharded / hbm)
    if sharding.grads:
        # A reduce-scatter per microbatch, started in its backward and running beside the microbatches after it:
        # exposed is what the step's compute from the first backward on cannot cover, at least the last bucket.
        hidden = (m - 1) * (micro[0] + micro[1]) + micro[1] if sw.overlap_grad_reduce else 0.0
        grad = max(m * grad - hidden, LAST_BUCKET_FRACTION * grad if sw.overlap_grad_reduce else m * grad)
    elif sw.overlap_grad_reduce:
        grad = max(grad - micro[1], LAST_BUCKET_FRACTION * grad)
    if sw.overlap_param_gather:
        gather = max(gather - micro[0], LAST_BUCKET_FRACTION * gather)
    opt_params = sharded if sharding.optimizer else params + experts
    return dict(dp_comm=grad + gather, optimizer=OPTIMIZER_STEP_BYTES * opt_params / hbm)


def estimate(model: ModelConfig, layout: Layout, gpu: GPUSpec, global_batch: int, seq: int,
             gpus_per_node: int = 8, software: Software = Software()) -> Estimate:
    """Memory and step time of one layout (which must be valid: see candidate_layouts)."""
    m = global_batch // (layout.dp * layout.micro_batch_size)
    links = _links(layout, gpu, gpus_per_node, software.cp_comm_type == "all_gather")
    c = _costs(model, layout, seq, gpu, software, links)
    stage_times, stage_bwd = _stage_times(model, layout, c)
    slowest = max(range(layout.pp), key=lambda r: stage_times[r])
    t_stage = stage_times[slowest]
    compute = m * t_stage
    bubble = _bubble(layout, m, t_stage, stage_bwd[slowest],
                     split_backward_costs(model, seq, layout.recompute))
    params, experts, _ = param_split_per_rank(model, layout)[slowest]
    micro = (t_stage - stage_bwd[slowest], stage_bwd[slowest])
    dp = _data_parallel_seconds(params, layout, gpu, software, links.dp, micro, m, experts, links.edp)
    step = compute + bubble + dp["dp_comm"] + dp["optimizer"]

    mem = memory_per_gpu(model, layout, seq, m, software.precision, software.flash_attention,
                         overlap_grad_reduce=software.overlap_grad_reduce,
                         overlap_param_gather=software.overlap_param_gather)
    n_gpus = layout.num_gpus
    model_flops = flops_per_iteration(model, global_batch, seq, None, layout.tp)
    hw_flops = flops_per_iteration(model, global_batch, seq,
                                   None if layout.recompute == "none" else layout.recompute, layout.tp)
    n_layers = max(sum(ch) for ch in stage_layer_counts(model.num_layers, layout))
    breakdown = dict(compute=compute, bubble=bubble, **dp,
                     tp_comm_per_layer=2 * _all_reduce(2 * layout.micro_batch_size * seq / layout.cp
                                                       * model.hidden_size, layout.tp, links.tp),
                     cp_comm=m * n_layers * c.cp_comm,
                     ep_comm=m * max(moe_layers_per_rank(model, layout)) * c.moe_a2a)
    return Estimate(layout, mem, mem.total <= gpu.memory_gib * GIB, step, breakdown,
                    global_batch * seq / step, model_flops / step / n_gpus / 1e12,
                    hw_flops / step / n_gpus / 1e12, model_flops / step / n_gpus / 1e12 / gpu.peak_tflops)


"""Step time of a parallel layout (the search over layouts is engine/planner/search.py).

One training iteration on a pipeline is modelled as (Narayanan et al. 2021, sec. 2.2 and 3):

    step = (m + (p - 1)/v) · T_stage  +  exposed data-parallel reduction  +  optimizer step

with m microbatches per pipeline, T_stage the forward+backward time of one microbatch on the slowest
pipeline rank, and (p - 1)/v the pipeline bubble of 1F1B (v = 1) or the interleaved schedule; the
zero-bubble schedules (Layout.pipeline_schedule zb-h1, zb-v) take theirs from the schedule simulator
(engine.pipeline.schedules.bubble_time): the order the engine runs, built for the model's FLOPs split of the
backward into input and weight gradients (engine.flops.split_backward_costs), replayed at the stage's times.
T_stage sums the stage's layers, pipeline sends, embedding and output layer as engine/planner/layer_time.py
costs them, over the links of engine/planner/links.py. Expert gradients reduce over their dp/ep x cp replicas.
Under --optimizer muon (Software.muon) the optimizer step adds Muon's Newton-Schulz work and exchanges
(engine/planner/muon_step.py; breakdown key `muon`). With --fp8-param-gather (Software.gathers_fp8) each gather of
the dense parameters and of the routed experts' (ZeRO-1/2's one a step, ZeRO-3's two a microbatch) moves what
engine/planner/fp8_gather.py counts (the FP8 linears' and experts' weights one byte an element), after the small
amax all-reduces (once a step).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from engine.config import ModelConfig
from engine.attention_mask import packed_lengths
from engine.flops import Costs, GPUSpec
from engine.planner.counts import attention_pairs, flops_per_iteration, param_split_per_rank, split_backward_costs
from engine.planner.fp8_gather import fp8_gather_bytes
from engine.layout import Layout
from engine.pipeline.schedules import bubble_time
from engine.planner.layer_time import (GEMM_EFFICIENCY, GEMM_EFFICIENCY_DEFAULT, HBM_EFFICIENCY, LayerCosts,
                                      layer_costs)
from engine.planner.links import Link, all_reduce, group_links
from engine.planner.memory import GIB, Memory, memory_per_gpu
from engine.planner.muon_step import muon_cost
from engine.planner.params import PARAM_BYTES
from engine.planner.software import Software
from engine.planner.stages import end_ranks, moe_layers_per_rank, stage_layer_counts

# With overlap, gradient reduction hides behind the last microbatch's backward pass except for the
# last bucket (Megatron-LM default buckets of 40M parameters: a few % of a large stage).
LAST_BUCKET_FRACTION = 0.05
# FSDP (parameters sharded and re-gathered for every microbatch): the fraction of its collectives that
# overlap hides. Fitted on the held-in llm-foundry H100 runs (PyTorch 2.0-era FSDP keeps the NCCL kernels
# and the GEMMs competing for the same SMs, and prefetches one layer ahead: little of it is hidden).
FSDP_HIDDEN_FRACTION = 0.3
# Adam step bytes per parameter of the (sharded) state: read+write fp32 master, m, v (24), read the
# fp32 gradient (4), write the 2-byte weight (2).
OPTIMIZER_STEP_BYTES = 30


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


def _stage_times(model: ModelConfig, layout: Layout, c: LayerCosts) -> tuple:
    """(forward+backward seconds of one microbatch on each pipeline rank, backward seconds of each); ZB-V's V
    puts the output layer (and the MTP modules after it) on rank 0, beside the embedding (stages.end_ranks)."""
    embed_rank, head_rank = end_ranks(layout)
    layer = c.layer_fwd + c.layer_bwd + c.layer_recompute + c.cp_comm
    moe_layer = c.moe_fwd + c.moe_bwd + c.moe_recompute + c.cp_comm
    n_moe = moe_layers_per_rank(model, layout) if model.num_experts else None
    # MTP's modules on the head's rank: a layer like the last (never recomputed) and the output layer again each
    mtp_moe = model.num_layers - 1 in model.moe_layers()
    mtp = (model.mtp_num_layers or 0) * ((c.moe_fwd + c.moe_bwd if mtp_moe else c.layer_fwd + c.layer_bwd)
                                         + c.cp_comm + c.head)
    times, bwd, seen = [], [], {}
    for r, chunks in enumerate(stage_layer_counts(model.num_layers, layout)):
        k = (sum(chunks), len(chunks), n_moe[r] if n_moe else 0, r == embed_rank, r == head_rank)
        if k not in seen:  # ranks alike cost alike: most of a deep pipeline is its middle stages
            n, moe = k[0] - k[2], k[2]
            seen[k] = (n * layer + moe * moe_layer + 2 * k[1] * c.p2p + (c.embed if k[3] else 0.0)
                       + (c.head + mtp if k[4] else 0.0),
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


def _data_parallel_seconds(params: int, layout: Layout, gpu: GPUSpec, sw: Software, link: Link,
                           micro: tuple, m: int, experts: int = 0, expert_link: Optional[Link] = None,
                           gathered: Optional[int] = None, experts_gathered: Optional[int] = None) -> dict:
    """Exposed gradient reduction and parameter gathering over the dp x cp replicas (and the `experts`
    parameters' over their dp/ep x cp replicas, on expert_link), and the Adam step.
    micro: (forward, backward) seconds of one microbatch on the slowest stage; m: microbatches; `gathered`:
    the bytes one gather of the dense parameters produces when not theirs in the run's precision (ZeRO-1/2's
    step gather, or one of ZeRO-3's two passes of unit gathers a microbatch: --fp8-param-gather,
    engine/planner/fp8_gather.py), and `experts_gathered` the experts' likewise."""
    width = PARAM_BYTES[sw.precision]
    groups = [(params, layout.shard_group, link, width * params if gathered is None else gathered)]
    if experts:
        groups.append((experts, layout.expert_shard_group, expert_link or link,
                       width * experts if experts_gathered is None else experts_gathered))
    sharding = layout.sharding
    grad = sum(all_reduce(sw.grad_reduce_bytes * p, n, lk) for p, n, lk, _ in groups)
    gather = 0.0
    if sharding.optimizer:
        grad /= 2  # reduce-scatter only
        gather = sum(all_reduce(w, n, lk) for _, n, lk, w in groups) / 2
    sharded = sum(p / n for p, n, _, _ in groups)
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


def _amax_seconds(fp8, layout: Layout, sw: Software, links) -> float:
    """--fp8-param-gather's amax all-reduces before the gathers (fp8: fp8_gather_bytes), one fp32 per FP8 linear's
    weight over the replicas, and under tensorwise (current) scaling over tp x cp too; one per expert of each
    stacked expert weight over the experts' replicas; latency-bound, never overlapped."""
    current = all_reduce(4 * fp8.weights, layout.tp * layout.cp, links.cp) if sw.fp8 == "tensorwise" else 0.0
    experts = all_reduce(4 * fp8.expert_amaxes, layout.expert_shard_group, links.edp or links.dp) \
        if fp8.expert_amaxes else 0.0
    return all_reduce(4 * fp8.weights, layout.shard_group, links.dp) + current + experts


def _muon_seconds(model: ModelConfig, layout: Layout, rank: int, gpu: GPUSpec, links, settings) -> float:
    """Muon's step on pipeline rank `rank` beyond the element-wise work counted with Adam's: the Newton-Schulz
    matmuls at the layers' GEMM efficiency (bf16 tensor cores; fp32 at TF32's half rate) and the exchanges
    over the replicas and tp (engine/planner/muon_step.py), not overlapped with anything."""
    cost = muon_cost(model, layout, rank, settings)
    efficiency = GEMM_EFFICIENCY.get(gpu.name, GEMM_EFFICIENCY_DEFAULT) * (1 if settings.bf16 else 0.5)
    sent = [(cost.dp_bytes, links.dp), (cost.edp_bytes, links.edp or links.dp), (cost.tp_bytes, links.tp)]
    return cost.flops / (gpu.peak_tflops * 1e12 * efficiency) + sum(link.seconds(b) for b, link in sent if b)


def estimate(model: ModelConfig, layout: Layout, gpu: GPUSpec, global_batch: int, seq: int,
             gpus_per_node: int = 8, software: Software = Software()) -> Estimate:
    """Memory and step time of one layout (which must be valid: see candidate_layouts)."""
    m = global_batch // (layout.dp * layout.micro_batch_size)
    links = group_links(layout, gpu, gpus_per_node, software.cp_comm_type == "all_gather")
    c = layer_costs(model, layout, seq, gpu, software, links)
    stage_times, stage_bwd = _stage_times(model, layout, c)
    slowest = max(range(layout.pp), key=lambda r: stage_times[r])
    t_stage = stage_times[slowest]
    compute = m * t_stage
    bubble = _bubble(layout, m, t_stage, stage_bwd[slowest],
                     split_backward_costs(model, seq, layout.recompute))
    params, experts, _ = param_split_per_rank(model, layout)[slowest]
    micro = (t_stage - stage_bwd[slowest], stage_bwd[slowest])
    fp8 = fp8_gather_bytes(model, layout, software.precision, slowest) \
        if software.gathers_fp8(layout.sharding) else None
    dp = _data_parallel_seconds(params, layout, gpu, software, links.dp, micro, m, experts, links.edp,
                                None if fp8 is None else fp8.gathered, None if fp8 is None else fp8.experts_gathered)
    if fp8 is not None:
        dp["dp_comm"] += _amax_seconds(fp8, layout, software, links)
    if software.muon is not None:
        dp["muon"] = _muon_seconds(model, layout, slowest, gpu, links, software.muon)
    step = compute + bubble + dp["dp_comm"] + dp["optimizer"] + dp.get("muon", 0.0)

    mem = memory_per_gpu(model, layout, seq, m, software.precision, software.flash_attention,
                         overlap_grad_reduce=software.overlap_grad_reduce,
                         overlap_param_gather=software.overlap_param_gather,
                         fp8_param_gather=software.gathers_fp8(layout.sharding), fp8=software.fp8,
                         fp8_output_layer=software.fp8_output_layer,
                         optimizer="adam" if software.muon is None else "muon")
    n_gpus = layout.num_gpus
    pairs = global_batch * attention_pairs(model, packed_lengths(seq, software.document_length))
    model_flops = flops_per_iteration(model, global_batch, seq, None, layout.tp, pairs)
    hw_flops = flops_per_iteration(model, global_batch, seq,
                                   None if layout.recompute == "none" else layout.recompute, layout.tp, pairs)
    n_layers = max(sum(ch) for ch in stage_layer_counts(model.num_layers, layout))
    breakdown = dict(compute=compute, bubble=bubble, **dp,
                     tp_comm_per_layer=2 * all_reduce(2 * layout.micro_batch_size * seq / layout.cp
                                                      * model.hidden_size, layout.tp, links.tp),
                     cp_comm=m * n_layers * c.cp_comm,
                     ep_comm=m * max(moe_layers_per_rank(model, layout)) * c.moe_a2a)
    return Estimate(layout, mem, mem.total <= gpu.memory_gib * GIB, step, breakdown,
                    global_batch * seq / step, model_flops / step / n_gpus / 1e12,
                    hw_flops / step / n_gpus / 1e12, model_flops / step / n_gpus / 1e12 / gpu.peak_tflops)

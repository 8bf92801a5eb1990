"""The search over parallel layouts: every valid (tp, cp, pp, vpp, dp, ep, micro batch, recomputation, pipeline
schedule, data-parallel sharding strategy)
for a model on N GPUs, each estimated by engine.planner.step_time and ranked fastest first. For a mixture
of experts, ep runs over the sizes dividing both dp and the number of experts (expert ranks are carved from
dp), and tp > 1 comes with sequence parallelism (the engine requires it: each tp rank routes its own tokens)."""
from __future__ import annotations

import copy
import math
from typing import Iterator, Optional

from engine.config import SHARDING_STRATEGIES, ModelConfig
from engine.flops import GPUSpec
from engine.layout import SCHEDULE_KINDS, Layout, Sharding
from engine.planner.counts import pinned
from engine.planner.step_time import Software, estimate

# Search limits: micro batch sizes tried (powers of two up to this), virtual stages per rank, and the
# largest context-parallel size. cp is tried at every sequence length, at every power of two that leaves each
# rank at least MIN_CP_TOKENS tokens of a sequence: the shortest share published runs back (NVIDIA's Llama 3 8B
# and 70B recipes run cp 2 at 8K in FP8, NeMo docs/source/performance/performance_summary.md; the calibration's
# Llama 3 405B cp 16 at 128K keeps 8192). Below it the step-time model is unchecked and leaves out what grows
# there: attention kernels on short blocks run below their efficiency, and cp ring steps add launches and syncs.
MAX_MICRO_BATCH = 16
MAX_VPP = 8
MAX_CP = 32
MIN_CP_TOKENS = 4096
# Pipeline schedules searched unless asked otherwise: the engine's defaults (1f1b, interleaved with vpp > 1).
# The zero-bubble ones are priced by simulating their order (engine.pipeline.schedules.bubble_time), some
# tens of milliseconds a layout: tools/find_parallelism.py searches them with --pipeline-schedule all.
DEFAULT_SCHEDULES = tuple(name for name, kind in SCHEDULE_KINDS.items() if not kind.split_backward)


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


def context_sizes(seq: int, room: int) -> list:
    """cp values worth trying: 1, and the powers of two up to MAX_CP dividing `room` (the GPUs left per tp
    group) whose 2*cp chunks cut the sequence evenly and leave each rank at least MIN_CP_TOKENS tokens."""
    powers = (2 ** i for i in range(1, MAX_CP.bit_length()))
    return [1] + [c for c in powers if room % c == 0 and seq % (2 * c) == 0 and seq // c >= MIN_CP_TOKENS]


def not_searched(model: ModelConfig, num_gpus: int, gpus_per_node: int, seq: int, schedules: tuple) -> list:
    """What candidate_layouts leaves out for this job, each with its reason, one phrase apiece (the tool prints
    them, so a user knows what to ask for with --tp/--cp/--pp/--vpp)."""
    out = []
    over = [c for c in (2 ** i for i in range(1, num_gpus.bit_length())) if num_gpus % c == 0 and seq % (2 * c) == 0]
    short = [c for c in over if c <= MAX_CP and seq // c < MIN_CP_TOKENS]
    if short:
        out.append(f"cp {short[0]} and above (each rank would hold under {MIN_CP_TOKENS} tokens of a sequence, "
                   "shorter than any published run backs; ask for one with --tp/--cp/--pp)")
    elif any(c > MAX_CP for c in over):
        out.append(f"cp above {MAX_CP}")
    if num_gpus > gpus_per_node:
        out.append(f"tp above {gpus_per_node} (a tp group stays inside a node: its per-layer all-reduces need NVLink)")
    out.append(f"vpp above {MAX_VPP} and micro batches above {MAX_MICRO_BATCH}")
    missing = [name for name in SCHEDULE_KINDS if name not in schedules]
    if missing:
        out.append(f"the pipeline schedules {', '.join(missing)} (--pipeline-schedule all searches them)")
    if model.num_layers > 1:
        out.append("uneven pipeline stages where pp divides the layers")
    out.append("partial recomputation (--recompute-num-layers)")
    return out


def _tensor_sizes(model: ModelConfig, num_gpus: int, gpus_per_node: int) -> list:
    nq, nkv, ffn = model.num_attention_heads, model.resolved_query_groups(), model.resolved_ffn_hidden_size()
    shared = model.moe_shared_expert_intermediate_size or 0
    return [tp for tp in _divisors(min(gpus_per_node, num_gpus))
            if not (gpus_per_node % tp or nq % tp or nkv % tp or ffn % tp or num_gpus % tp or shared % tp)]


def expert_sizes(model: ModelConfig, dp: int) -> list:
    """ep values for a model on dp data-parallel ranks: those dividing dp and the experts (1 without MoE)."""
    return [e for e in _divisors(dp) if model.num_experts and model.num_experts % e == 0] or [1]


def _options(layout_args: tuple, tp: int, dp: int, seq: int, cp: int, ep: int = 1, moe: bool = False,
             strategies: tuple = SHARDING_STRATEGIES, schedule: Optional[str] = None) -> Iterator[Layout]:
    """Recomputation, sequence parallelism and the data-parallel sharding strategy for one (tp, cp, pp, dp, ep,
    mb, vpp, schedule); with one replica (dp x cp = 1) nothing is sharded: no_shard only."""
    tp_, pp, vpp, mb, split = layout_args
    sps = (False, True) if tp > 1 and seq % (tp * cp) == 0 else (False,)
    if moe and tp > 1:
        sps = (True,) if seq % (tp * cp) == 0 else ()
    for recompute in ("none", "selective", "full"):
        for sp in sps:
            for strategy in (strategies if dp * cp > 1 else (Sharding().strategy,)):
                yield Layout(tp, pp, dp, vpp, mb, recompute, sp, first_stage_layers=split[0] if split else None,
                             last_stage_layers=split[1] if split else None, cp=cp, ep=ep, sharding_strategy=strategy,
                             pipeline_schedule=schedule)


def schedules_for(num_layers: int, pp: int, vpp: int, split: Optional[tuple], allowed: tuple) -> list:
    """(vpp, schedule) pairs the engine runs for this split: with vpp > 1 the schedules taking --vpp's chunks
    (interleaved); with vpp 1 those running one chunk per rank (1f1b, zb-h1) and those with a fixed number k > 1
    of equal chunks (zb-v: 2) when k pp divides the layers evenly; pp 1: no schedule."""
    if pp == 1:
        return [(1, None)]
    kinds = [(name, SCHEDULE_KINDS[name]) for name in allowed]
    if vpp > 1:
        return [(vpp, name) for name, kind in kinds if kind.chunks is None]
    out = [(1, name) for name, kind in kinds if kind.chunks == 1]
    return out + [(kind.chunks, name) for name, kind in kinds if (kind.chunks or 1) > 1 and split is None
                  and num_layers % (kind.chunks * pp) == 0]


def candidate_layouts(model: ModelConfig, num_gpus: int, gpus_per_node: int, global_batch: int,
                      seq: int, strategies: tuple = SHARDING_STRATEGIES,
                      schedules: tuple = DEFAULT_SCHEDULES) -> Iterator[Layout]:
    """Every valid layout: tp inside a node dividing heads, query groups and the MLP widths; cp where each rank
    keeps MIN_CP_TOKENS of a sequence; pp dividing the layers (or an uneven split); vpp for even splits; micro
    batches dividing the batch; ep dividing dp and the experts; the pipeline `schedules` and data-parallel sharding
    `strategies` given (default: every strategy, the engine's default schedules; PIPELINE_SCHEDULES for all)."""
    L = model.num_layers
    for tp in _tensor_sizes(model, num_gpus, gpus_per_node):
        for cp in context_sizes(seq, num_gpus // tp):
            for pp in _divisors(num_gpus // (tp * cp)):
                dp = num_gpus // (tp * cp * pp)
                split = None if L % pp == 0 else uneven_split(L, pp)
                if pp > L or global_batch % dp or (L % pp and split is None):
                    continue
                per_dp = global_batch // dp
                for mb in (x for x in (2 ** i for i in range(MAX_MICRO_BATCH.bit_length())) if per_dp % x == 0):
                    vpps = [1]
                    if split is None and pp > 1 and (per_dp // mb) % pp == 0:
                        vpps += [v for v in _divisors(L // pp) if 1 < v <= MAX_VPP]
                    runs = [r for v in vpps for r in schedules_for(L, pp, v, split, schedules)]
                    for vpp, schedule in runs:
                        for ep in expert_sizes(model, dp):
                            yield from _options((tp, pp, vpp, mb, split), tp, dp, seq, cp, ep, bool(model.num_experts),
                                                strategies, schedule)


def rank_layouts(model: ModelConfig, num_gpus: int, gpu: GPUSpec, global_batch: int, seq: int,
                 gpus_per_node: int = 8, software: Software = Software(), strategies: tuple = SHARDING_STRATEGIES,
                 schedules: tuple = DEFAULT_SCHEDULES) -> list:
    """All candidate layouts ranked by `rank_key`: those that fit, fastest first, then those that do not."""
    with pinned(copy.deepcopy(model)) as own:  # a copy no caller can change while the counts are keyed on it
        out = [estimate(own, lay, gpu, global_batch, seq, gpus_per_node, software)
               for lay in candidate_layouts(own, num_gpus, gpus_per_node, global_batch, seq, strategies, schedules)]
    out.sort(key=rank_key)
    return out


def rank_key(e) -> tuple:
    """Layouts that fit first, fastest first (ties: the lighter); then those that do not fit, nearest to fitting
    first (least memory), whatever their speed: one that does not fit is never ranked among those that do."""
    return (0, round(e.step_time_s, 6), e.memory.total) if e.fits else (1, e.memory.total, e.step_time_s)


def chinchilla_optimal(compute_flops: float) -> tuple:
    """(parameters, tokens) minimising loss for a FLOP budget: Hoffmann et al. 2022 find tokens ≈ 20 x
    parameters at the optimum; with C = 6·N·D that is N = sqrt(C/120), D = 20·N."""
    n = math.sqrt(compute_flops / 120.0)
    return n, 20.0 * n

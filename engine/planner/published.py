"""Published large-scale training runs the step-time model is checked against, and its prediction for each.

Every case gives what its source published: the model's shape, the GPU and how many, tp, pp, cp, the
batch, the sequence length, the recomputation and the achieved TFLOP/s per GPU (hardware FLOPs, with
the recomputed forward, for Narayanan et al.; model FLOPs, i.e. reported MFU x the dense bf16 peak, for
the others). What a source left out (micro batch, virtual stages) is the planner's best choice. The
constants of engine/planner/layer_time.py and step_time.py marked "fitted" were fitted on the cases with
held_out False; the held-out ones never entered a fit.

FLOP conventions: every source here counts attention over the full s x s score matrix, as
engine/flops.py does (Narayanan eq. 3; llm-foundry's `attn_flops_per_seq`; torchtitan's
12·l·h·s per token), except Llama 3, which does not state its count: the full-s² count is assumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.config import ModelConfig
from engine.flops import GPU_PRESETS
from engine.layout import Layout
from engine.planner.step_time import Estimate, Software, estimate

# Megatron-LM of 2021-22 (Narayanan, Korthikanti): unfused softmax attention, fp16 with 2-byte gradient
# all-reduce after the backward pass, no distributed optimizer.
OLD_MEGATRON = Software(flash_attention=False, overlap_grad_reduce=False, precision="fp16", grad_reduce_bytes=2)
# MosaicML llm-foundry on H100 (2023): PyTorch FSDP FULL_SHARD, bf16 compute with fp32 gradient
# reduction (Composer's DEFAULT mixed precision), tp = pp = 1, and the Triton flash-attention kernel of
# 2023, slower than the GPU's default (FLASH_ATTENTION_EFFICIENCY): its 0.35 of peak is fitted on the
# held-in long-sequence runs (3B at 16K, 1B at 64K tokens).
LLM_FOUNDRY = Software(overlap_param_gather=True, attention_efficiency=0.35)  # its cases shard optim_grads_params
# Meta's Llama 3 stack (Dubey et al. 2024, sec. 3.3.2): sharded optimizer and gradients with parameters
# gathered once per step and overlapped, flash attention; CP gathers K/V with all-gather.
LLAMA3 = Software(overlap_param_gather=True, cp_comm_type="all_gather")
# Dubey et al. 2024, sec. 3.3.2, "Parallelism for model scaling": "Our use of FSDP for Llama 3 shards the
# optimizer states and gradients, but for the model shards we do not reshard after forward computation to avoid
# an extra all-gather communication during backward passes" -- ZeRO-2, this engine's optim_grads (weights whole
# for the step, fp32 gradients reduce-scattered per microbatch: "we use FP32 gradient accumulation during
# backward computation over multiple micro-batches and also reduce-scatter gradients in FP32 across data
# parallel workers in FSDP"). Recorded as plain ZeRO-1 (optim) before, which keeps a whole fp32 gradient
# (11.9 GiB per GPU at tp 8 x pp 16) the run never held. No activation recomputation at 8K ("With these
# optimizations, we could pretrain Llama 3 on 8K tokens without activation checkpointing"), and no dropout.
LLAMA3_SHARDING = "optim_grads"


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: ModelConfig = field(repr=False)
    gpu: str
    gpus: int
    tp: int
    pp: int
    global_batch: int
    recompute: str
    reported: float                      # TFLOP/s per GPU as the source reports it
    metric: str                          # "hw" (with recomputation) or "model"
    held_out: bool
    software: Software = field(repr=False)
    cp: int = 1
    micro_batch: Optional[int] = None    # None: not published, the planner picks the best
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    uneven: Optional[tuple] = None       # (first, last) stage layers
    interleaved: bool = True             # whether the source may have used virtual stages
    sharding_strategy: Optional[str] = None  # data-parallel sharding (None: optim when distributed_optimizer)
    memory_modelled: bool = True         # False: the source's schedule holds a count of activations the planner
    #                                      cannot model, so its memory does not rule the published choice out

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def seq(self) -> int:
        return self.model.seq_length


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """A GPT-3-shaped model (LayerNorm, GELU MLP of 4h, learned positions, biases) with Megatron-LM's dropout
    of 0.1 on the residual branches and the attention probabilities (the runs of Narayanan and Korthikanti,
    whose activation count, Table 2 of the latter, includes the masks)."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                       seq_length=seq, hidden_dropout=0.1, attention_dropout=0.1)


def mpt(layers: int, hidden: int, heads: int, seq: int) -> ModelConfig:
    """MosaicML MPT (llm-foundry yamls): GELU MLP of 4h, no biases, ALiBi (no position parameters; rope
    stands in, it has none either), 50368-token vocabulary."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=50368,
                       seq_length=seq, max_position_embeddings=seq, disable_bias_linear=True,
                       position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)


def llama3(layers: int, hidden: int, heads: int, ffn: int, seq: int) -> ModelConfig:
    """Llama 3 (Dubey et al. 2024, Table 3): 8 key/value groups, SwiGLU, RMSNorm, rope, untied 128256 vocab."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=8,
                       ffn_hidden_size=ffn, vocab_size=128256, seq_length=seq, max_position_embeddings=seq,
                       normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                       untie_embeddings_and_output_weights=True, disable_bias_linear=True, hidden_dropout=0.0,
                       attention_dropout=0.0)


def _narayanan() -> list:
    t1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
          (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
          (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
          (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
          (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
    src = "Narayanan et al. 2021, arXiv:2104.04473"
    out = [Published(f"GPT {p}B on {g} A100", f"{src}, Table 1", gpt(l, h, a), "a100-80g", g, tp, pp,
                     B, "full", r, "hw", False, OLD_MEGATRON) for i, (p, a, h, l, tp, pp, g, B, r) in enumerate(t1)]
    out += [Published(f"GPT-3 175B on {g} A100", f"{src}, Table 2 (PTD-P)", gpt(96, 12288, 96), "a100-80g", g, 8, 12,
                      1536, "full", r, "hw", True, OLD_MEGATRON) for g, r in ((384, 153), (768, 149), (1536, 141))]
    out += [Published(f"GPT 530B on {g} A100", f"{src}, Table 2 (PTD-P)", gpt(105, 20480, 128), "a100-80g", g, 8, 35,
                      2240, "full", r, "hw", True, OLD_MEGATRON) for g, r in ((560, 171), (1120, 167), (2240, 159))]
    out.append(Published("GPT-3 175B on 1024 A100", f"{src}, sec. 5.1 text (pp not given: tp 8, best pp)",
                         gpt(96, 12288, 96), "a100-80g", 1024, 8, 0, 1536, "full", 140.0, "hw", True, OLD_MEGATRON))
    return out


def _korthikanti() -> list:
    src = "Korthikanti et al. 2022, arXiv:2205.05198, Table 5 (SP + selective; MFU x 312)"
    rows = (("22B", 48, 6144, 64, 1, 8, 4, 41.5), ("175B", 96, 12288, 96, 8, 64, 64, 51.4),
            ("530B", 105, 20480, 128, 35, 280, 280, 56.0), ("1T", 128, 25600, 160, 64, 512, 512, 56.3))
    return [Published(f"GPT {n} SP+selective on {g} A100", src, gpt(l, h, a), "a100-80g", g, 8, pp, B, "selective",
                      round(mfu * 3.12, 1), "model", True, OLD_MEGATRON, sequence_parallel=True)
            for n, l, h, a, pp, g, B, mfu in rows]


def _llm_foundry() -> list:
    src = "github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md, 'H100 80GB BF16' (MFU x 989)"
    shapes = {"1b": (24, 2048, 16), "3b": (32, 2560, 32), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
              "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
    rows = (("7b", 2048, 8, 6, 48, False, 46.44, False), ("13b", 2048, 64, 2, 128, False, 39.86, False),
            ("30b", 2048, 32, 14, 1344, True, 43.92, False), ("3b", 16384, 8, 1, 48, False, 36.34, False),
            ("1b", 65536, 8, 1, 16, True, 26.34, False), ("7b", 8192, 8, 8, 128, True, 37.14, True),
            ("70b", 2048, 64, 8, 2048, True, 42.57, True), ("13b", 32768, 8, 1, 24, True, 31.68, True),
            ("3b", 2048, 16, 10, 480, False, 43.73, True))
    return [Published(f"MPT-{m} seq {s} on {g} H100", src, mpt(*shapes[m], seq=s), "h100-sxm", g, 1, 1, B,
                      "full" if ckpt else "none", round(mfu * 9.89, 1), "model", held, LLM_FOUNDRY, micro_batch=mb,
                      distributed_optimizer=True, sharding_strategy="optim_grads_params")
            for m, s, g, mb, B, ckpt, mfu, held in rows]


def _llama3() -> list:
    src = "Dubey et al. 2024, 'The Llama 3 Herd of Models', arXiv:2407.21783, Table 4"
    m8k, m128k = llama3(126, 16384, 128, 53248, 8192), llama3(126, 16384, 128, 53248, 131072)
    # Interleaved (sec. 3.3.2) with Meta's own schedule (Figure 6: N contiguous microbatches per chunk, "finding
    # a sweet spot between DFS and BFS for the best communication and memory efficiency"), N and v unpublished.
    # The planner counts Megatron's interleaved order (N = pp), whose warm-up holds more: with it the 8K layout
    # needs 88-121 GiB per GPU at v 2-8 and fits only without interleaving (76 GiB, 1F1B); so memory does not
    # rule out the published interleaving here (memory_modelled False).
    common = dict(micro_batch=1, sequence_parallel=True, distributed_optimizer=True, uneven=(7, 7),
                  sharding_strategy=LLAMA3_SHARDING, memory_modelled=False)
    return [Published("Llama 3 405B 8K on 8,192 H100", src, m8k, "h100-sxm", 8192, 8, 16, 2048, "none", 430.0,
                      "model", False, LLAMA3, **common),
            Published("Llama 3 405B 8K on 16,384 H100", src, m8k, "h100-sxm", 16384, 8, 16, 2048, "none", 400.0,
                      "model", True, LLAMA3, **common),
            Published("Llama 3 405B 128K on 16,384 H100", src, m128k, "h100-sxm", 16384, 8, 16, 128, "none",
                      380.0, "model", True, LLAMA3, cp=16, **common)]


PUBLISHED = _narayanan() + _korthikanti() + _llm_foundry() + _llama3()


def _layouts(case: Published) -> list:
    """The published layout with every unpublished choice (micro batch, virtual stages) left open."""
    pps = [case.pp] if case.pp else [p for p in (1, 2, 4, 8, 16, 32, 64) if case.model.num_layers % p == 0]
    out = []
    for pp in pps:
        dp = case.gpus // (case.tp * case.cp * pp)
        per_dp = case.global_batch // dp
        mbs = [case.micro_batch] if case.micro_batch else [b for b in (1, 2, 4, 8, 16) if per_dp % b == 0]
        layers = case.model.num_layers // pp
        for mb in mbs:
            vpps = [1] + ([v for v in range(2, 9) if layers % v == 0 or case.uneven]
                          if pp > 1 and case.interleaved and (per_dp // mb) % pp == 0 else [])
            out += [Layout(case.tp, pp, dp, v, mb, case.recompute, case.sequence_parallel,
                           case.distributed_optimizer, *(case.uneven or (None, None)), case.cp,
                           sharding_strategy=case.sharding_strategy) for v in vpps]
    return out


def predict(case: Published) -> Estimate:
    """The planner's estimate for the published layout: the fastest of the open choices that fits in
    memory (or the fastest, where the planner's memory model does not cover the run's schedule)."""
    gpu = GPU_PRESETS[case.gpu]
    ests = [estimate(case.model, lay, gpu, case.global_batch, case.seq, 8, case.software) for lay in _layouts(case)]
    fitting = [e for e in ests if e.fits or not case.memory_modelled]
    return min(fitting or ests, key=lambda e: e.step_time_s)


def predicted_tflops(case: Published) -> float:
    e = predict(case)
    return e.hw_tflops_per_gpu if case.metric == "hw" else e.tflops_per_gpu


def relative_error(case: Published) -> float:
    return (predicted_tflops(case) - case.reported) / case.reported


def markdown_table(cases: list = PUBLISHED) -> str:
    """Case, layout, source, reported and predicted TFLOP/s per GPU, error: for docs/planner.md."""
    lines = ["| case | GPU | tp | pp | cp | dp | recompute | reported TFLOP/s | predicted | error | fit/held out | source |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        e = predict(c)
        got = e.hw_tflops_per_gpu if c.metric == "hw" else e.tflops_per_gpu
        lines.append(f"| {c.name} | {c.gpu} | {c.tp} | {e.layout.pp} | {c.cp} | {e.layout.dp} | {c.recompute} | "
                     f"{c.reported:.0f} ({c.metric}) | {got:.0f} | {(got - c.reported) / c.reported:+.1%} | "
                     f"{'held out' if c.held_out else 'fit'} | {c.source} |")
    return "\n".join(lines)


def case_table(cases: list = PUBLISHED) -> str:
    """Every case as a fixed-width text table (the test module lists it verbatim), sources numbered below."""
    sources = list(dict.fromkeys(c.source for c in cases))
    head = (f"{'case':<33} {'GPU':<8} {'GPUs':>6} {'tp':>2} {'pp':>3} {'cp':>2} {'dp':>4} {'mb':>3} {'batch':>5} "
            f"{'seq':>6} {'recompute':<9} {'TFLOP/s':>7} {'of':<5} {'use':<8} src")
    rows = [head]
    for c in cases:
        rows.append(f"{c.name:<33} {c.gpu:<8} {c.gpus:>6} {c.tp:>2} {c.pp or '-':>3} {c.cp:>2} "
                    f"{c.dp if c.pp else '-':>4} {c.micro_batch or '-':>3} {c.global_batch:>5} {c.seq:>6} "
                    f"{c.recompute:<9} {c.reported:>7.1f} {c.metric:<5} {'held out' if c.held_out else 'fit':<8} "
                    f"[{sources.index(c.source) + 1}]")
    rows += [f"[{i + 1}] {s}" for i, s in enumerate(sources)]
    return "\n".join(r.rstrip() for r in rows)


def calibrated(model: ModelConfig) -> bool:
    """Whether a published run of the model's kind (dense, or a mixture of experts) entered the fit of the
    step-time model's constants; the tool marks the other predictions uncalibrated."""
    moe = bool(model.num_experts)
    return any(bool(c.model.num_experts) == moe and not c.held_out for c in PUBLISHED)

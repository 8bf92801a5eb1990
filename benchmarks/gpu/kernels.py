"""Section 3, the kernels forward and backward: Triton against torch eager, torch.compile and SDPA's backends.

benchmarks/kernel_speed.py builds and times every case (its measure_case: median of device-event-timed
repetitions, random inputs, backward over a retained graph); this section picks the sizes, watches the clock
between cases and records each row as it comes. Bandwidth-bound kernels are reported in TB/s of the fewest
bytes they must move, attention in TFLOP/s of the causal half of the score matrix (the FlashAttention papers'
count), at their benchmark shapes: 16k tokens, hidden 2048, head dim 64 and 128, sequence 2k/4k/8k.
torch.compile is not timed for attention: compiling SDPA calls the same SDPA kernels timed beside it.
"""
from __future__ import annotations

import torch

from benchmarks import kernel_speed
from benchmarks.gpu.context import NEEDS_CUDA

BANDWIDTH_ANCHOR = ">= 2.6 TB/s on H100 (Liger RMSNorm 2.83); goal >= 80% of the measured copy"
ANCHORS = {"cross_entropy": ">= 1.45 TB/s at V = 128k", "attention_d128": "FA2 ~265-330, FA3 ~530-580 TFLOP/s",
           "attention_d64": "the sdpa-flash row of the same shape"}
CUDA_ONLY = {"attention": "triton, sdpa-flash, sdpa-cudnn, sdpa-efficient", "other": "triton, torch.compile"}


def anchor(kernel: str) -> str:
    for prefix, text in ANCHORS.items():
        if kernel.startswith(prefix):
            return text
    return BANDWIDTH_ANCHOR


def todo(opts) -> dict:
    """Case name -> builder, most important first: the bandwidth kernels, then attention by head dim."""
    dtype = torch.bfloat16 if opts.cuda else torch.float32
    bandwidth = {k: v for k, v in kernel_speed.cases(opts.device, dtype, quick=opts.dry_run).items()
                 if not k.startswith("attention")}
    seqs = opts.pick((2048, 4096, 8192), (4096, 8192), (128,))
    dims = opts.pick((128, 64), (128, 64), (64,))
    tokens, hidden = opts.pick(16384, 16384, 256), opts.pick(2048, 2048, 128)
    return {**bandwidth, **kernel_speed.attention_grid(opts.device, dtype, seqs, dims, tokens, hidden)}


def rate(row: dict) -> tuple:
    """(fwd+bwd rate, unit) of a kernel_speed row: TB/s for bandwidth, TFLOP/s for attention."""
    if "fwd_bwd_tflops" in row:
        return row["fwd_bwd_tflops"], "TFLOP/s"
    return kernel_speed.significant(row["fwd_bwd_gbps"] / 1000), "TB/s"


def run(opts, record, earlier) -> None:
    """Each case if its likely cost fits what is left; every implementation's row recorded as it comes."""
    reps = opts.pick(20, 10, 2)
    for name, case in todo(opts).items():
        if not record.has_time(name, 15.0 if opts.cuda else 1.0):  # a torch.compile of one case: ~5-15 s
            continue
        for row in kernel_speed.measure_case(name, case, opts.device, reps):
            row["anchor"] = anchor(name)
            if "error" in row:
                record.row("kernels", row, f"{name} {row['impl']}: error {row['error']}")
                continue
            value, unit = rate(row)
            row["rate"], row["unit"] = value, unit
            record.row("kernels", row, f"{name} {row['impl']}: fwd+bwd {value:.4g} {unit} (fwd {row['fwd_ms']:.3f} "
                                       f"ms, bwd {row['bwd_ms']:.3f} ms; anchor {row['anchor']})")
        if not opts.cuda:
            record.skip(f"{name}: {CUDA_ONLY['attention' if name.startswith('attention') else 'other']}", NEEDS_CUDA)

"""Where one engine step's time goes, for each precision named: wall time against the profiler's device and host
time, the operators with the most device time and those with the most host time, and dynamo's counters.

A step whose wall time is far above its device time is host-bound (launches, Python, guards); one whose device
time is high has slow kernels. Issue 34's FP8 steps ran at 0.47-0.65x bf16 on the H200 (2026-11-27) while their
GEMMs and casts were each faster in isolation: this says which.

Where the bf16 step fuses its weight gradients into the fp32 ones (gradient-accumulation fusion, on CUDA), the same
trainer's step is timed without the fusion and with it again: `fusion_gain`, the unfused step over the fused.

    PYTHONPATH=. python3 -m benchmarks.gpu.step_profile --precisions bf16,delayed,tensorwise --out DIR

A precision `RECIPE+head` (delayed+head) is that FP8 recipe with the output layer in FP8 too (--fp8-output-layer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu import models
from benchmarks.gpu.bench import (GEMM_OPS, MICROBATCHES, finish, product_tflop, products_summed, release,
                                  timed_iterations)
from benchmarks.train import engine_trainer, process_group
from engine.parallel import grad_accumulation


def profile_step(precision: str, size: str, micro: int, warm: int, top: int) -> dict:
    """Warm `warm` steps, time them, then profile one: a dict of figures and operator rows."""
    cuda = torch.cuda.is_available()
    recipe, _, head = precision.partition("+")  # e.g. delayed+head: with --fp8-output-layer
    if head not in ("", "head"):
        raise SystemExit(f"step_profile: --precisions {precision!r}: the one suffix is +head (--fp8-output-layer)")
    extra = [] if precision == "bf16" else ["--fp8-format", "hybrid", "--fp8-recipe", recipe,
                                            *(["--fp8-output-layer"] if head else [])]
    cfg = models.config("llama", size, micro, MICROBATCHES, 3 * warm + 1, bf16=cuda, extra=extra)
    ctx, trainer = engine_trainer(cfg, "cuda:0" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        walls = timed_iterations(trainer, warm, cuda)[0]
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        t0 = time.perf_counter()
        with profile(activities=activities, record_shapes=True) as prof:
            trainer.iterate()
            sync()
        profiled = time.perf_counter() - t0
        events = list(prof.key_averages())
        # kernels only: an operator's own device time is its kernels', which are listed too
        device = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        host = sum(e.self_cpu_time_total for e in events) / 1e3
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

        def rows(key):
            return [{"op": e.key[:90], "ms": round(key(e) / 1e3, 3), "calls": e.count}
                    for e in sorted(events, key=key, reverse=True)[:top]]
        from torch._dynamo.utils import counters
        shaped = prof.key_averages(group_by_input_shape=True)
        return {"precision": precision, "step_ms": round(1e3 * statistics.median(walls[1:] or walls), 2),
                "profiled_step_ms": round(1e3 * profiled, 2), "device_ms": round(device, 2),
                "host_self_ms": round(host, 2), "kernels": kernels,
                "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")},
                "by_device": rows(lambda e: e.self_device_time_total),
                "by_host": rows(lambda e: e.self_cpu_time_total),
                "products": products(shaped),
                # operators by input shapes: which tensors the copies and casts move (the FP8 steps ran 256 more
                # aten::copy_ than bf16's on the H200, 5.7 ms more device time: 64 of them, nearly all that time,
                # the held weights' transposes, now made with their codes)
                "by_shape": [{"op": e.key[:60], "shapes": str(e.input_shapes)[:100],
                              "ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count}
                             for e in sorted(shaped, key=lambda e: e.self_device_time_total, reverse=True)[:top]
                             if e.device_type != torch.autograd.DeviceType.CUDA],
                **(fusion_gain(trainer, warm, cuda) if precision == "bf16" else {})}
    finally:
        finish(ctx, trainer)
        del trainer
        release(cuda)


def fusion_gain(trainer, steps: int, cuda: bool) -> dict:
    """Where the step fuses its weight gradients into the fp32 ones (engine.parallel.grad_accumulation; CUDA), the
    same trainer's step without, then with it again: {unfused_step_ms, fused_step_ms, fusion_gain (unfused over
    fused)}, measured in one process on one model. Empty where nothing is fused."""
    if not grad_accumulation.fused_count(p for chunk in trainer.chunks for p in chunk.parameters()):
        return {}
    with grad_accumulation.unfused():
        unfused = timed_iterations(trainer, steps, cuda)[0]
    fused = timed_iterations(trainer, steps, cuda)[0]
    u, f = (statistics.median(t[1:] or t) for t in (unfused, fused))
    return {"unfused_step_ms": round(1e3 * u, 2), "fused_step_ms": round(1e3 * f, 2), "fusion_gain": round(u / f, 4)}


def products(shaped) -> dict:
    """The step's matrix products (bf16 aten::mm and FP8 aten::_scaled_mm alike) summed: calls, TFLOP, device ms and
    their rate, from the profiler's input shapes (benchmarks.gpu.bench.product_tflop)."""
    return products_summed([{"tflop": product_tflop(e.key, e.input_shapes, e.count), "calls": e.count,
                             "device_ms": e.self_device_time_total / 1e3} for e in shaped if e.key in GEMM_OPS])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="bf16,delayed,tensorwise")
    parser.add_argument("--size", default="full")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--warm", type=int, default=6)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    results = []
    for precision in args.precisions.split(","):
        with process_group(torch.cuda.is_available()):
            r = profile_step(precision, args.size, args.micro, args.warm, args.top)
        results.append(r)
        print(f"\n## {precision}: step {r['step_ms']} ms (profiled {r['profiled_step_ms']}), "
              f"device {r['device_ms']} ms, host self {r['host_self_ms']} ms, {r['kernels']} kernels; "
              f"products {r['products']}; dynamo {r['dynamo']}"
              + (f"; gradient-accumulation fusion {r['fusion_gain']}x (unfused {r['unfused_step_ms']} ms, fused "
                 f"{r['fused_step_ms']} ms)" if "fusion_gain" in r else ""), flush=True)
        for title, key in (("device", "by_device"), ("host", "by_host")):
            print(f"| {precision} by {title} | ms | calls |\n|---|---|---|")
            for row in r[key]:
                print(f"| {row['op']} | {row['ms']} | {row['calls']} |")
        print(f"| {precision} operator | input shapes | device ms | calls |\n|---|---|---|---|")
        for row in r["by_shape"]:
            print(f"| {row['op']} | {row['shapes']} | {row['ms']} | {row['calls']} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "step_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

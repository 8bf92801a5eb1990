"""One model's training loops side by side in one process: built together, stepped in alternating order on
the same batches, each step timed and its memory metered.

Alternating (round r starts with loop r mod n) makes a change in the machine's state hit every loop alike.
Memory: the loops are resident together, so each one's own peak is its persistent bytes (what building it
and its first step left allocated: weights, gradient buffers, optimizer state) plus the most any of its steps
allocated above what was allocated before that step (torch.cuda.max_memory_allocated after a reset). That is
what the same loop alone would report, up to allocator rounding.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.gpu import loops, models
from benchmarks.kernel_speed import significant
from benchmarks.train import engine_trainer

MICROBATCHES = 2   # per step: the gradient accumulation every real run does, so the optimizer step is amortised
MAX_ITERS = 64     # the engine's schedule and mock data are sized for this many steps
# the matrix products a profile lists by input shapes (the H200's compiled engine step of 2026-11-27 ran 390 aten::mm
# against the plain loop's 326, the same model: which ones differ is what the shapes say)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::_scaled_mm")


class Bench:
    """The engine, plain and transformers loops of one model at one micro batch, with their timings."""

    def __init__(self, family: str, size: str, micro_batch: int, device: str):
        self.family, self.device, self.cuda = family, device, device.startswith("cuda")
        self.cfg = models.config(family, size, micro_batch, MICROBATCHES, MAX_ITERS, bf16=self.cuda)
        self.round = 0
        self.loops, self.persistent = {}, {}
        self.times, self.losses, self.peaks, self.errors = {}, {}, {}, {}
        base = self._allocated()
        self.ctx, trainer = engine_trainer(self.cfg, device)  # the engine's model and optimizer: its bytes
        self.trainer = trainer
        try:
            self._add(lambda: loops.EngineLoop(trainer), base)
            plain = self._add(lambda: loops.TorchLoop(self.cfg, self.ctx, trainer, device))
            self._add(lambda: loops.TransformersLoop(self.cfg, self.ctx, trainer, device, plain.model))
        except BaseException:
            self.close()  # an out-of-memory here is answered with a smaller micro batch: free this one first
            raise
        self.round = 1

    def _add(self, make, base=None):
        """Build (`make()`) and first step (round 0) of one loop, metering what it keeps allocated from `base`
        (default: now, before the build)."""
        base = self._allocated() if base is None else base
        loop = make()
        self.loops[loop.name] = loop
        self.losses[loop.name] = [loop.step(0)]
        self._sync()
        self.persistent[loop.name] = self._allocated() - base
        return loop

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def rounds(self, count: int, measured: bool, phase: str) -> None:
        """`count` rounds, every live loop one step each, in rotating order; timed into `phase` if measured."""
        for _ in range(count):
            names = list(self.loops)
            if not names:
                return
            k = self.round % len(names)
            for name in names[k:] + names[:k]:
                self._timed_step(name, phase, measured)
            self.round += 1

    def _timed_step(self, name: str, phase: str, measured: bool) -> None:
        """One step of one loop; an exception in it is kept as that loop's error and the loop stops stepping."""
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        base = self._allocated()
        start = time.perf_counter()
        key = (name, phase)
        try:
            self.losses[name].append(self.loops[name].step(self.round))
            self._sync()
        except Exception as exc:  # noqa: BLE001 - one loop failing (a compile error, OOM) must not stop the others
            self.errors[key] = f"{type(exc).__name__}: {exc}"[:600]
            self.drop(name)
            return
        seconds = time.perf_counter() - start
        self.times.setdefault(key if measured else (name, phase + ":warm-up"), []).append(seconds)
        if self.cuda and measured:  # steady state: not the compiling or first steps
            self.peaks[key] = max(self.peaks.get(key, 0), torch.cuda.max_memory_allocated() - base)

    def batch(self) -> dict:
        """The first microbatch of the run's first step, on the device (what a check outside the rounds runs)."""
        from engine.data import make_batch
        return make_batch(self.trainer.train_ds, list(range(self.cfg.training.micro_batch_size)), device=self.device)

    def drop(self, name: str) -> None:
        """Stop stepping a loop that failed (its state is no longer trustworthy)."""
        self.loops.pop(name, None)

    def compile(self, name: str, backend: str) -> None:
        loops.compile_layers(self.loops[name], backend)

    def summary(self, name: str, phase: str) -> dict:
        """Median step time, warm-up (compile) seconds and peak bytes of one loop in one phase."""
        times = self.times.get((name, phase), [])
        warm = self.times.get((name, phase + ":warm-up"), [])
        peak = self.persistent[name] + self.peaks[(name, phase)] if (name, phase) in self.peaks else None
        return {"step_s": statistics.median(times) if times else None, "steps": len(times),
                "warm_up_s": round(sum(warm), 2), "peak_bytes": peak}

    def profile(self, name: str, top: int = 15) -> tuple:
        """One step of loop `name` under torch.profiler: (the `top` operators by their own device time, as
        {op, device_ms, share, calls}, the shares of the step's whole device time; every matrix product, as
        {op, shapes, device_ms, calls}, by operator and input shapes). The other loops take the same round's step
        untimed, so that all still train on the same batches."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        with profile(activities=activities, record_shapes=True) as prof:
            self.losses[name].append(self.loops[name].step(self.round))
            self._sync()
        for other in [n for n in self.loops if n != name]:
            self.losses[other].append(self.loops[other].step(self.round))
        self.round += 1
        events = list(prof.key_averages())
        own = (lambda e: e.self_device_time_total) if self.cuda else (lambda e: e.self_cpu_time_total)
        total = sum(own(e) for e in events) or 1.0
        events.sort(key=own, reverse=True)
        rows = [{"op": e.key[:80], "device_ms": round(own(e) / 1e3, 3), "share": round(own(e) / total, 4),
                 "calls": e.count} for e in events[:top]]
        products = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key in GEMM_OPS),
                          key=own, reverse=True)
        gemms = [{"op": e.key, "shapes": str(e.input_shapes)[:120], "device_ms": round(own(e) / 1e3, 3),
                  "calls": e.count, "tflop": product_tflop(e.key, e.input_shapes, e.count)} for e in products]
        return rows, gemms

    def close(self) -> None:
        """Free everything (the next model, or the next micro batch to try, needs the memory)."""
        self.loops.clear()
        finish(self.ctx, self.trainer)
        self.trainer = None
        release(self.cuda)


def product_tflop(op: str, shapes: list, calls: int):
    """TFLOP of `calls` matrix products `op` with these input shapes (2 m n k each, times the batch), or None for
    aten::matmul, a wrapper whose product is also listed as the aten::mm or aten::bmm it runs."""
    if op == "aten::matmul" or not shapes:
        return None
    a, b = shapes[1:3] if op in ("aten::addmm", "aten::baddbmm") else shapes[:2]  # addmm's first is what it adds
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1] * calls / 1e12


def products_summed(rows: list) -> dict:
    """Matrix products summed from rows of {tflop, device_ms, calls} (a wrapper's row, tflop None, left out):
    {calls, tflop, device_ms, tflops_rate}."""
    counted = [r for r in rows if r["tflop"] is not None]
    tflop, ms = sum(r["tflop"] for r in counted), sum(r["device_ms"] for r in counted)
    return {"calls": sum(r["calls"] for r in counted), "tflop": significant(tflop, 6), "device_ms": round(ms, 3),
            "tflops_rate": significant(tflop / (ms / 1e3)) if ms else None}


def timed_iterations(trainer, n: int, cuda: bool) -> tuple:
    """(seconds, loss) of each of `n` engine iterations, each timed from a drained device to a drained device."""
    times, losses = [], []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.iterate()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(trainer.last_record["lm_loss"])
    return times, losses


def finish(ctx, trainer) -> None:
    """After a trainer driven step by step: its stop-signal handlers put back (engine_trainer says why) and the
    parallel context destroyed; the caller drops the trainer, then `release`s the device memory."""
    trainer.preemption.restore()
    ctx.destroy()


def release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

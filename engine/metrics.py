"""What a run reports: the metrics JSON-lines file, TensorBoard scalars, and the console line.

Rank 0 writes everything; other ranks get a writer whose methods do nothing, so the trainer calls them
unconditionally. The JSON-lines file is opened for appending: a resumed (or rolled-back) run adds
records after the old ones, and readers keep the last record of each iteration (tools/plot_metrics.py
does). TensorBoard gets `purge_step` on resume, which hides the old events past the resumed iteration.

Record kinds, one JSON object per line:
- training:   {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale", "skipped",
               "tokens_per_sec", "tflops_per_gpu", "mfu", ...any extra keys the trainer adds}
- validation: {"iteration", "split": "valid", "lm_loss", "ppl"}
- event:      {"iteration", "event": KIND, ...details}  (KIND: spike, rollback, skip, nan, ...)
NaN and inf are not JSON: they are written as null (the event record says what happened).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

import torch

from engine.planner import flops

TRAIN_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale", "skipped",
              "tokens_per_sec", "tflops_per_gpu", "mfu")
# record key -> TensorBoard tag (the tags are part of the user-facing contract)
TB_TAGS = {"lm_loss": "lm-loss", "lr": "lr", "grad_norm": "grad-norm", "loss_scale": "loss-scale",
           "tokens_per_sec": "tokens-per-sec", "tflops_per_gpu": "tflops-per-gpu", "mfu": "mfu",
           "mem_peak_gb": "mem-peak-gb"}
PPL_MAX_LOSS = 20.0  # exp() of a larger loss is meaningless and overflows fp32 readers


def metrics_path(cfg) -> Optional[str]:
    """--metrics-file, else <tensorboard-dir>/metrics.jsonl, else <save>/metrics.jsonl, else None."""
    log, save = cfg.logging, cfg.checkpoint.save
    if log.metrics_file:
        return log.metrics_file
    if log.tensorboard_dir:
        return os.path.join(log.tensorboard_dir, "metrics.jsonl")
    if save:
        return os.path.join(save, "metrics.jsonl")
    return None


def peak_tflops(cfg, device: torch.device) -> Optional[float]:
    """--peak-tflops, else the preset of the CUDA device in use, else None (MFU is then not reported)."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    if device.type == "cuda":
        spec = flops.detect_gpu(torch.cuda.get_device_name(device))
        return spec.peak_tflops if spec else None
    return None


def throughput(model, global_batch_size: int, seconds: float, num_gpus: int, tp_size: int,
               peak: Optional[float]) -> dict:
    """Per-iteration speed fields of a training record, from the iteration's wall time.

    `model`: the ModelConfig. TFLOP/s count model FLOPs (no recomputation, engine.planner.flops), so
    mfu = tflops_per_gpu / peak.
    """
    seq = model.seq_length
    tokens_per_sec = global_batch_size * seq / seconds
    model_flops = flops.flops_per_iteration(model, global_batch_size, seq, tp=tp_size)
    tflops = flops.tflops_per_gpu(model_flops, seconds, num_gpus)
    return {"tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_gpu": tokens_per_sec / num_gpus,
            "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None, "iter_time_s": seconds}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, PPL_MAX_LOSS))


def peak_memory_gb(device: torch.device) -> Optional[float]:
    """Peak allocated CUDA memory since start (GiB), None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def _clean(value):
    """Tensors and numpy scalars to Python numbers; non-finite floats to None."""
    if hasattr(value, "item"):  # torch tensors and numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """`log_train(record)`, `log_valid(iteration, loss)`, `log_event(iteration, kind, **info)`, `close()`.

    `start_iteration`: the iteration a resumed run continues from (0 for a fresh run).
    """

    def __init__(self, cfg, rank: int, start_iteration: int = 0):
        self.path = metrics_path(cfg) if rank == 0 else None
        self.file = None
        self.tb = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most a line
        if rank == 0 and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only where it is used
            self.tb = SummaryWriter(cfg.logging.tensorboard_dir,
                                    purge_step=start_iteration + 1 if start_iteration else None)

    def _write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}, allow_nan=False) + "\n")

    def _scalar(self, tag: str, value, step: int) -> None:
        value = _clean(value)
        if self.tb and isinstance(value, (int, float)) and not isinstance(value, bool):
            self.tb.add_scalar(tag, value, step)

    def log_train(self, record: dict) -> None:
        missing = [k for k in TRAIN_KEYS if k not in record]
        if missing:
            raise ValueError(f"training record lacks {', '.join(missing)} (None is allowed, absence is not)")
        self._write(record)
        for key, tag in TB_TAGS.items():
            if key in record:
                self._scalar(tag, record[key], record["iteration"])

    def log_valid(self, iteration: int, loss: float, **extra) -> None:
        loss = _clean(loss)
        ppl = perplexity(loss) if loss is not None else None
        self._write({"iteration": iteration, "split": "valid", "lm_loss": loss, "ppl": ppl, **extra})
        self._scalar("valid/lm-loss", loss, iteration)
        self._scalar("valid/ppl", ppl, iteration)

    def log_event(self, iteration: int, kind: str, **info) -> None:
        self._write({"iteration": iteration, "event": kind, "time": time.time(), **info})

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.tb:
            self.tb.close()
            self.tb = None


def _si(x: float) -> str:
    """12345678 -> '12.3M'."""
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_log_line(record: dict) -> str:
    """One compact console line from a training record; fields that are absent or None are left out.

    Besides the TRAIN_KEYS it reads the optional keys train_iters, consumed_tokens (else
    consumed_samples is shown), tokens_per_sec_per_gpu, mem_peak_gb, iter_time_s and eta_s (else the
    ETA is the remaining iterations times iter_time_s).
    """
    r = {k: _clean(v) for k, v in record.items()}
    have = lambda key: r.get(key) is not None  # noqa: E731
    total = r.get("train_iters")
    parts = [f"iter {r['iteration']}" + (f"/{total}" if total else "")]
    if have("consumed_tokens"):
        parts.append(f"tokens {_si(r['consumed_tokens'])}")
    elif have("consumed_samples"):
        parts.append(f"samples {_si(r['consumed_samples'])}")
    parts.append(f"loss {r['lm_loss']:.4f}" if have("lm_loss") else "loss nan")
    if have("lr"):
        parts.append(f"lr {r['lr']:.3e}")
    if have("grad_norm"):
        parts.append(f"gnorm {r['grad_norm']:.3f}")
    if have("loss_scale"):
        parts.append(f"scale {r['loss_scale']:g}")
    if have("skipped"):
        parts.append(f"skipped {r['skipped']}")
    if have("tokens_per_sec"):
        per_gpu = f" ({_si(r['tokens_per_sec_per_gpu'])}/gpu)" if have("tokens_per_sec_per_gpu") else ""
        parts.append(f"{_si(r['tokens_per_sec'])} tok/s{per_gpu}")
    if have("tflops_per_gpu"):
        t = r["tflops_per_gpu"]
        parts.append(f"{t:.1f} TFLOP/s/gpu" if t >= 10 else f"{t:.3g} TFLOP/s/gpu")
    if have("mfu"):
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if have("mem_peak_gb"):
        parts.append(f"mem {r['mem_peak_gb']:.1f} GiB")
    if have("iter_time_s"):
        parts.append(f"{1000 * r['iter_time_s']:.0f} ms/it")
    if have("eta_s"):
        parts.append(f"ETA {_duration(r['eta_s'])}")
    elif have("iter_time_s") and total:
        parts.append(f"ETA {_duration(max(total - r['iteration'], 0) * r['iter_time_s'])}")
    return " | ".join(parts)

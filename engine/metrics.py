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

The console line (`LogInterval`, printed every --log-interval iterations) follows Megatron-LM's layout and
shows the interval, not its last iteration: the loss averaged over the interval, the speed as its tokens
over its time, and an ETA from the speed since start. `save_report` words the lines around a checkpoint
save; `arguments_path` is where the launcher keeps the resolved arguments (engine.report.report_arguments).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import threading
import time
from typing import Optional

import torch

from engine import flops

TRAIN_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale", "skipped",
              "tokens_per_sec", "tflops_per_gpu", "mfu")
# record key -> TensorBoard tag (the tags are part of the user-facing contract)
TB_TAGS = {"lm_loss": "lm-loss", "lr": "lr", "grad_norm": "grad-norm", "loss_scale": "loss-scale",
           "tokens_per_sec": "tokens-per-sec", "tflops_per_gpu": "tflops-per-gpu", "mfu": "mfu",
           "mem_peak_gb": "mem-peak-gb", "moe_aux_loss": "moe/aux-loss", "moe_z_loss": "moe/z-loss",
           "moe_max_load": "moe/max-load", "moe_dropped": "moe/dropped-tokens",
           "mtp_loss": "mtp-loss"}
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


def arguments_path(cfg) -> Optional[str]:
    """Where the resolved arguments are kept: beside the metrics file, its name with `.args.json` for the
    extension (`<tensorboard-dir>/metrics.args.json` by default); None when there is no metrics file."""
    path = metrics_path(cfg)
    return os.path.splitext(path)[0] + ".args.json" if path else None


def peak_tflops(cfg, device: torch.device) -> Optional[float]:
    """--peak-tflops, else the preset of the CUDA device in use, else None (MFU is then not reported)."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    if device.type == "cuda":
        spec = flops.detect_gpu(torch.cuda.get_device_name(device))
        return spec.peak_tflops if spec else None
    return None


def throughput(model, global_batch_size: int, seconds: float, num_gpus: int, tp_size: int,
               peak: Optional[float], pairs: Optional[int] = None) -> dict:
    """Per-iteration speed fields of a training record, from the iteration's wall time.

    `model`: the ModelConfig. TFLOP/s count model FLOPs (no recomputation, engine.flops), so
    mfu = tflops_per_gpu / peak; `pairs`: the iteration's attention pairs when its samples pack documents
    (the sum of L_i^2 over them, counted by the pipeline runner), else each sample's whole square.
    """
    seq = model.seq_length
    tokens_per_sec = global_batch_size * seq / seconds
    model_flops = flops.flops_per_iteration(model, global_batch_size, seq, tp=tp_size, pairs=pairs)
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


def _wandb_run(cfg):
    """A Weights & Biases run logging the TensorBoard scalars under the same tags (Megatron-LM's --wandb-* flags);
    validation has checked that the package is there."""
    import wandb  # optional: only runs that ask for it need it
    lg = cfg.logging
    return wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, dir=lg.wandb_save_dir, entity=lg.wandb_entity,
                      config=cfg.to_dict(), resume="allow")


class MetricsWriter:
    """`log_train(record)`, `log_valid(iteration, loss)`, `log_event(iteration, kind, **info)`, `close()`.

    `start_iteration`: the iteration a resumed run continues from (0 for a fresh run). `log_train` returns
    the console line when one is due (see `LogInterval`), else None.
    """

    def __init__(self, cfg, rank: int, start_iteration: int = 0):
        self.console = LogInterval(cfg.logging.log_interval)
        self.path = metrics_path(cfg) if rank == 0 else None
        self.file = None
        self.tb = None
        self.wandb = _wandb_run(cfg) if rank == 0 and cfg.logging.wandb_project else None
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.tb:
                self.tb.add_scalar(tag, value, step)
            if self.wandb:
                self.wandb.log({tag: value}, step=step)

    def log_train(self, record: dict) -> Optional[str]:
        """Write the iteration's record as it is (per iteration); return the console line if one is due."""
        missing = [k for k in TRAIN_KEYS if k not in record]
        if missing:
            raise ValueError(f"training record lacks {', '.join(missing)} (None is allowed, absence is not)")
        self._write(record)
        for key, tag in TB_TAGS.items():
            if key in record:
                self._scalar(tag, record[key], record["iteration"])
        return self.console.add(record)

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
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


def _si(x: float, digits: int = 3) -> str:
    """12345678 -> '12.3M' (`digits` significant digits)."""
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}g}{suffix}"
    return f"{x:.{digits}g}"


def _duration(seconds: float) -> str:
    """3700 -> '1:01:40'; a day or more -> '2 days, 3:04:05'."""
    return str(datetime.timedelta(seconds=round(seconds)))


def timestamp(seconds: float) -> str:
    """Epoch seconds -> '[2026-11-23 15:40:01]' (local time), the prefix of the console line."""
    return time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime(seconds))


def _number(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def format_log_line(record: dict) -> str:
    """The console line, in Megatron-LM's layout, from a training record or an interval's summary
    (`LogInterval.summary`); fields that are absent or None are left out.

    Besides the TRAIN_KEYS it reads the optional keys time (epoch seconds: the timestamp), train_iters,
    consumed_tokens, iter_time_s, tokens_per_sec_per_gpu, mem_peak_gb, skipped_iterations (those of the
    interval; without it the line shows none), eta_s (else the remaining iterations times iter_time_s) and
    optimizer (a Muon run's).
    """
    r = {k: _clean(v) for k, v in record.items()}
    have = lambda key: r.get(key) is not None  # noqa: E731
    total = r.get("train_iters")
    head = f"{timestamp(r['time'])} " if have("time") else ""
    parts = [f"{head}iteration {r['iteration']:8d}" + (f"/{total:8d}" if total else "")]
    if have("consumed_samples"):
        parts.append(f"consumed samples: {r['consumed_samples']:12d}")
    if have("consumed_tokens"):
        parts.append(f"consumed tokens: {_si(r['consumed_tokens'], 4)}")
    if have("iter_time_s"):
        parts.append(f"elapsed time per iteration (ms): {1000 * r['iter_time_s']:.1f}")
    if have("tflops_per_gpu"):
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {_number(r['tflops_per_gpu'])}")
    if have("tokens_per_sec"):
        per_gpu = f" ({r['tokens_per_sec_per_gpu']:,.0f} per GPU)" if have("tokens_per_sec_per_gpu") else ""
        parts.append(f"tokens per second: {r['tokens_per_sec']:,.0f}{per_gpu}")
    if have("mfu"):
        parts.append(f"MFU: {_number(100 * r['mfu'])}%")
    if have("optimizer"):  # a Muon run's (Adam's line is Megatron-LM's, which names none)
        parts.append(f"optimizer: {r['optimizer']}")
    if have("lr"):
        parts.append(f"learning rate: {r['lr']:.6E}")
    parts.append(f"lm loss: {r['lm_loss']:.6E}" if have("lm_loss") else "lm loss: nan")
    if have("mtp_loss"):  # multi-token prediction (engine.mtp): the mean of its modules' losses
        parts.append(f"mtp loss: {r['mtp_loss']:.6E}")
    if have("loss_scale"):
        parts.append(f"loss scale: {r['loss_scale']:.1f}")
    if have("grad_norm"):
        parts.append(f"grad norm: {r['grad_norm']:.3f}")
    if have("mem_peak_gb"):
        parts.append(f"peak memory (GiB): {r['mem_peak_gb']:.2f}")
    if have("moe_max_load"):  # MoE runs: the last iteration's (engine.moe.stats)
        parts.append(f"moe aux loss: {r['moe_aux_loss']:.4E} | expert load max/mean: {r['moe_max_load']:.2f} | "
                     f"dropped tokens: {r['moe_dropped']}")
    if have("moe_node_tokens"):  # expert parallelism over nodes: the tokens each node's experts got
        parts.append(f"routed tokens per node: {'/'.join(str(n) for n in r['moe_node_tokens'])}")
    if have("skipped_iterations"):
        parts.append(f"number of skipped iterations: {r['skipped_iterations']:3d}")
    if have("eta_s"):
        parts.append(f"ETA: {_duration(r['eta_s'])}")
    elif have("iter_time_s") and total:
        parts.append(f"ETA: {_duration(max(total - r['iteration'], 0) * r['iter_time_s'])}")
    return " | ".join(parts)


def _skipped(r: dict) -> bool:
    """The stability guard's rule (engine.stability): a non-finite loss or gradient norm skips the step
    (records hold non-finite values as None once cleaned)."""
    return r.get("lm_loss") is None or ("grad_norm" in r and r["grad_norm"] is None)


class LogInterval:
    """The console line of every `log_interval` iterations, from the per-iteration training records.

    `add(record)` once per iteration; it returns the line when one is due (the iteration is a multiple of
    `log_interval`, or the record's last one, train_iters), else None. The line stands for the interval:
    - lm loss: the mean over its iterations, skipped ones (non-finite loss or grad norm) left out of the
      mean and counted in "number of skipped iterations";
    - tokens/s, TFLOP/s and MFU: the interval's tokens (FLOPs) over its total iteration time, i.e. each
      iteration's value weighted by its time; elapsed time per iteration: the mean;
    - lr, grad norm, loss scale, consumed samples/tokens, peak memory: the last iteration's;
    - ETA: the remaining iterations times the mean iteration time over every iteration this process has run
      except its first (warm-up), so it moves smoothly from line to line.
    Iteration times are the trainer's (the step itself): evaluation and checkpoint saves are not in them.
    """

    def __init__(self, log_interval: int = 1, clock=time.time):
        self.log_interval, self.clock = max(int(log_interval or 1), 1), clock
        self.records: list = []
        self.first_seconds: Optional[float] = None  # this process's first iteration: warm-up, not in the ETA
        self.seconds, self.iterations = 0.0, 0  # every timed iteration since

    def add(self, record: dict) -> Optional[str]:
        r = {k: _clean(v) for k, v in record.items()}
        self.records.append(r)
        if r.get("iter_time_s") is not None:
            if self.first_seconds is None:
                self.first_seconds = r["iter_time_s"]
            else:
                self.seconds, self.iterations = self.seconds + r["iter_time_s"], self.iterations + 1
        if r["iteration"] % self.log_interval and r["iteration"] != r.get("train_iters"):
            return None
        line = format_log_line(self.summary())
        self.records = []
        return line

    def seconds_per_iteration(self) -> Optional[float]:
        """The ETA's speed: the mean over every iteration since start but the first (that one while alone)."""
        return self.seconds / self.iterations if self.iterations else self.first_seconds

    def summary(self) -> dict:
        """The interval so far as one record (format_log_line's input); see the class docstring."""
        rs, last = self.records, self.records[-1]
        losses = [r["lm_loss"] for r in rs if not _skipped(r)]
        timed = [r for r in rs if r.get("iter_time_s")]
        seconds = sum(r["iter_time_s"] for r in timed)

        def per_second(key):  # sum(value * time) / sum(time) over the iterations that have the value
            pairs = [(r[key], r["iter_time_s"]) for r in timed if r.get(key) is not None]
            return sum(v * t for v, t in pairs) / sum(t for _, t in pairs) if pairs else None

        out = {**last, "lm_loss": sum(losses) / len(losses) if losses else None, "time": self.clock(),
               "skipped_iterations": len(rs) - len(losses), "interval_iterations": len(rs),
               "iter_time_s": seconds / len(timed) if timed else None, "eta_s": None}
        out.update({key: per_second(key) for key in ("tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu",
                                                      "mfu")})
        speed, total = self.seconds_per_iteration(), last.get("train_iters")
        if speed is not None and total:
            out["eta_s"] = max(total - last["iteration"], 0) * speed
        return out


@contextlib.contextmanager
def save_report(checkpointer, iteration: int, log=print):
    """The console lines around one checkpoint save; wrap `checkpointer.save(...)` in it (every rank does;
    `log` prints on rank 0 only). Before: "saving checkpoint at iteration N into DIR ...". After a
    synchronous save: "saved checkpoint at iteration N in X.XX s". With --async-save: "checkpoint save at
    iteration N scheduled (async) in X.XX s", then, from a thread that waits for rank 0's writer (the one
    that publishes the checkpoint), "saved checkpoint at iteration N in X.XX s (async)" once it is on disk.
    Nothing more is said when the save fails: the error ends the run (or the next save) on every rank.

    `checkpointer`: an engine.checkpoint.Checkpointer (its cfg, ctx and the save in flight, `pending`)."""
    ck = checkpointer.cfg.checkpoint
    log(f"saving checkpoint at iteration {iteration} into {ck.save}{' (async)' if ck.async_save else ''} ...")
    start = time.time()
    yield
    pending = checkpointer.pending
    if pending is None or getattr(pending, "thread", None) is None:
        log(f"saved checkpoint at iteration {iteration} in {time.time() - start:.2f} s")
        return
    log(f"checkpoint save at iteration {iteration} scheduled (async) in {time.time() - start:.2f} s")
    if checkpointer.ctx.rank == 0:  # Checkpointer.finalize waits for this line too, so it precedes the stop line
        pending.report = threading.Thread(target=_report_written, args=(pending, iteration, start, log), daemon=True,
                                          name=f"checkpoint-report-{iteration}")
        pending.report.start()


def _report_written(pending, iteration: int, start: float, log) -> None:
    pending.thread.join()
    if pending.error is None:
        log(f"saved checkpoint at iteration {iteration} in {time.time() - start:.2f} s (async)")


def train_record(o, guard, cfg, ctx, device, peak: float, seconds: float) -> dict:
    """The metrics file's training record of a settled iteration (an engine.stepping.Outcome)."""
    m, result = cfg.model, o.result
    record = {"iteration": o.iteration, "train_iters": cfg.training.train_iters, "consumed_samples": o.consumed,
              "consumed_tokens": o.consumed * m.seq_length, "lm_loss": o.loss, "lr": o.lr,
              "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": guard.skipped,
              "spikes": guard.spikes, "rollbacks": guard.rollbacks,
              "mem_peak_gb": peak_memory_gb(torch.device(device))} | o.routing
    if cfg.optim.optimizer != "adam":
        record["optimizer"] = cfg.optim.optimizer
    return record | throughput(m, o.global_batch, seconds, ctx.world_size, ctx.tp_size, peak, o.pairs)

"""The training loop: get batch, forward-backward schedule, reduce grads, step, log, evaluate, save.

`Trainer` builds everything from the config and the parallel context; `Trainer.train()` is the loop.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from engine import checkpoint, comm, flops
from engine.data import BatchSampler, RampupBatchSize, build_datasets, make_batch, samples_before
from engine.metrics import MetricsWriter, format_log_line, peak_memory_gb, peak_tflops, throughput
from engine.model import build_model_chunks
from engine.optim import build_optimizer, lr_at
from engine.pipeline import schedules
from engine.stability import ROLLBACK, SpikeGuard, corrupt_batch, parse_faults, poison_loss


def resolve_vocab_size(cfg) -> int:
    if cfg.data.tokenizer_model and not cfg.data.mock_data:
        from engine.data import Tokenizer
        return Tokenizer(cfg.data.tokenizer_model).vocab_size
    return cfg.model.vocab_size or 256


def model_dtype(cfg):
    return torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32


class Trainer:
    def __init__(self, cfg, ctx, device, log=print):
        self.cfg, self.ctx, self.device, self.log = cfg, ctx, device, log
        tr, par = cfg.training, cfg.parallel
        self.vocab_size = resolve_vocab_size(cfg)
        self.dtype = model_dtype(cfg)
        self.chunks = build_model_chunks(cfg, ctx, vocab_size=self.vocab_size, device=device, dtype=self.dtype)
        self.optimizer = build_optimizer(cfg, self.chunks, ctx)
        self.gbs = tr.global_batch_size or tr.micro_batch_size * ctx.dp_size
        self.batch_size = (RampupBatchSize(*tr.rampup_batch_size, self.gbs) if tr.rampup_batch_size else self.gbs)
        seq = cfg.model.seq_length
        self.shape = (seq // ctx.tp_size if ctx.sequence_parallel else seq, tr.micro_batch_size, cfg.model.hidden_size)
        eval_runs = (tr.train_iters // cfg.logging.eval_interval + 1) if cfg.logging.eval_interval else 0
        self.train_ds, self.valid_ds, _ = build_datasets(
            cfg, samples_before(tr.train_iters, self.batch_size), eval_runs * cfg.logging.eval_iters * self.gbs, 0)
        self.guard = SpikeGuard.from_config(cfg.stability)
        self.faults = parse_faults(cfg.stability.inject_fault)
        self.iteration, self.consumed, self.skipped = 0, 0, 0
        self.trace = [] if cfg.logging.pipeline_trace else None
        self.save_dir = cfg.checkpoint.save
        self.resume()
        self.metrics = MetricsWriter(cfg, ctx.rank, start_iteration=self.iteration)
        self.peak = peak_tflops(cfg, torch.device(device))
        self.preemption = checkpoint.PreemptionHandler(cfg.checkpoint.exit_duration_in_mins, device=device)

    # ------------------------------------------------------------------ state
    def resume(self) -> bool:
        load_dir = self.cfg.checkpoint.load or self.save_dir
        if not load_dir or checkpoint.latest_iteration(load_dir) is None:
            return False
        extra = checkpoint.load_checkpoint(load_dir, self.chunks, self.optimizer, self.ctx, self.cfg,
                                           fallback=self.cfg.checkpoint.ckpt_fallback,
                                           load_optim=not self.cfg.checkpoint.no_load_optim)
        if extra is None:
            return False
        self.iteration, self.consumed = extra["iteration"], extra["consumed_samples"]
        self.skipped = extra.get("skipped", 0)
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
        self.log(f"resumed from {load_dir} at iteration {self.iteration} ({self.consumed} samples consumed)")
        return True

    def save(self) -> None:
        extra = {"consumed_samples": self.consumed, "skipped": self.skipped, "guard": self.guard.state_dict(),
                 "data": {"consumed_samples": self.consumed}}
        checkpoint.save_checkpoint(self.save_dir, self.iteration, self.chunks, self.optimizer, self.ctx, self.cfg,
                                   extra, async_save=self.cfg.checkpoint.async_save)

    def rollback(self) -> None:
        """Reload the newest checkpoint, skip the data the spike came from, lower the LR for a while."""
        spike_consumed = self.consumed
        checkpoint.finalize_async()
        if not self.resume():
            self.log("rollback requested but no checkpoint exists; continuing")
            return
        self.guard.rolled_back(self.iteration)
        self.consumed = spike_consumed  # the batches since the checkpoint are not replayed
        self.metrics.log_event(self.iteration, "rollback", resumed_iteration=self.iteration,
                               skipped_to_samples=spike_consumed)
        self.log(f"rolled back to iteration {self.iteration}; data skipped to sample {spike_consumed}; "
                 f"LR x{self.guard.lr_multiplier(self.iteration + 1)}")

    # ------------------------------------------------------------------ one step
    def microbatches(self, dataset, consumed: int, global_batch: int) -> list:
        sampler = BatchSampler(consumed, global_batch, self.cfg.training.micro_batch_size, self.ctx.dp_rank,
                               self.ctx.dp_size)
        return [make_batch(dataset, idx, device=self.device) for idx in next(iter(sampler))]

    def global_batch(self) -> int:
        return self.batch_size(self.iteration) if callable(self.batch_size) else self.batch_size

    def train_step(self):
        gbs = self.global_batch()
        mbs = self.microbatches(self.train_ds, self.consumed, gbs)
        fault = self.faults.pop(self.iteration + 1, None)
        if fault == "spike":
            mbs = [corrupt_batch(mb, self.vocab_size) for mb in mbs]
        for model in self.chunks:
            model.train()
        self.optimizer.start_step(len(mbs))
        scale = self.optimizer.scale_loss
        if fault == "nan":
            scale = lambda loss: poison_loss(self.optimizer.scale_loss(loss))  # noqa: E731
        loss = schedules.run(self.chunks, mbs, self.ctx, shape=self.shape, dtype=self.dtype, device=self.device,
                             scale_loss=scale, trace=self.trace)
        self.optimizer.finish_grad_sync()
        if fault == "nan":
            loss = float("nan")
        position = self.iteration
        lr = lr_at(position, self.cfg.optim, self.cfg.training.train_iters) * self.guard.lr_multiplier(self.iteration + 1)
        result = self.optimizer.step(lr)
        self.iteration += 1
        self.consumed += gbs
        return loss, lr, result, gbs

    @torch.no_grad()
    def evaluate(self) -> float:
        for model in self.chunks:
            model.eval()
        losses, start = [], (self.iteration // self.cfg.logging.eval_interval - 1) * self.cfg.logging.eval_iters * self.gbs
        for i in range(self.cfg.logging.eval_iters):
            mbs = self.microbatches(self.valid_ds, (start + i * self.gbs) % max(len(self.valid_ds) - self.gbs + 1, 1),
                                    self.gbs)
            losses.append(schedules.run(self.chunks, mbs, self.ctx, shape=self.shape, dtype=self.dtype,
                                        device=self.device, forward_only=True))
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        cfg = self.cfg
        tr, lg, ck = cfg.training, cfg.logging, cfg.checkpoint
        tokens_per_sample = cfg.model.seq_length
        start_time, last = time.time(), time.time()
        while self.iteration < tr.train_iters:
            loss, lr, result, gbs = self.train_step()
            decision = self.guard.check(self.iteration, loss, result.grad_norm)
            if not result.updated or decision.kind == "skip":
                self.skipped += 1
                self.metrics.log_event(self.iteration, "skip", loss=loss, grad_norm=result.grad_norm)
            elif decision.kind in ("spike", ROLLBACK):
                self.metrics.log_event(self.iteration, "spike", loss=loss, threshold=self.guard.threshold())
            now = time.time()
            record = {"iteration": self.iteration, "train_iters": tr.train_iters, "consumed_samples": self.consumed,
                      "consumed_tokens": self.consumed * tokens_per_sample, "lm_loss": loss, "lr": lr,
                      "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                      "skipped": self.skipped, "mem_peak_gb": peak_memory_gb(torch.device(self.device)),
                      "eta_s": (now - start_time) / max(self.iteration, 1) * (tr.train_iters - self.iteration)}
            record.update(throughput(cfg, gbs, now - last, self.ctx.world_size, self.peak))
            last = now
            self.metrics.log_train(record)
            if self.iteration % lg.log_interval == 0 and self.ctx.rank == 0:
                self.log(format_log_line(record))
            if decision.kind == ROLLBACK and self.save_dir:
                self.rollback()
                continue
            if lg.eval_interval and self.iteration % lg.eval_interval == 0 and self.valid_ds is not None:
                vloss = self.evaluate()
                self.metrics.log_valid(self.iteration, vloss)
                if self.ctx.rank == 0:
                    self.log(f"validation at iteration {self.iteration}: loss {vloss:.4f} "
                             f"ppl {math.exp(min(vloss, 20)):.2f}")
            stop = self.preemption.should_stop()
            if self.save_dir and ((ck.save_interval and self.iteration % ck.save_interval == 0) or stop):
                self.save()
            if stop:
                self.log(f"stopping at iteration {self.iteration} (pre-emption signal or --exit-duration-in-mins)")
                break
        if self.save_dir and self.iteration == tr.train_iters and checkpoint.latest_iteration(self.save_dir) != self.iteration:
            self.save()
        checkpoint.finalize_async()
        self.write_trace()
        self.metrics.close()

    def write_trace(self) -> None:
        if self.trace is None:
            return
        path = f"{self.cfg.logging.pipeline_trace}.rank{self.ctx.rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            for rank, pp_rank, kind, mb, chunk, t0, t1 in self.trace:
                fh.write(json.dumps({"rank": rank, "pp_rank": pp_rank, "kind": kind, "microbatch": mb,
                                     "chunk": chunk, "start": t0, "end": t1}) + "\n")


def banner(cfg, ctx, trainer, layout: str) -> str:
    """Start-up summary printed by rank 0: layout, parameters, batch arithmetic, kernels."""
    from kernels import dispatch
    local = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    total = flops.count_parameters(cfg.model, trainer.vocab_size) if hasattr(flops, "count_parameters") else None
    tr = cfg.training
    accum = trainer.gbs // (tr.micro_batch_size * ctx.dp_size)
    lines = [f"Ternion: world {ctx.world_size} = tp {ctx.tp_size} x pp {ctx.pp_size} x dp {ctx.dp_size}"
             f"{f' (vpp {ctx.vpp_size})' if ctx.vpp_size > 1 else ''}, sequence parallel {ctx.sequence_parallel}",
             layout,
             f"parameters on rank 0 (pp stage 0): {local:,}" + (f"; model total {total:,}" if total else ""),
             f"batch: micro {tr.micro_batch_size} x dp {ctx.dp_size} x accumulation {accum} = global {trainer.gbs}",
             f"kernels: {json.dumps(dispatch.kernel_report(torch.device(trainer.device), cfg.model.attention_backend))}"]
    return "\n".join(lines)

"""The training loop: get batch, forward-backward schedule, reduce grads, step, log, evaluate, save.

`Trainer` builds everything from the config and the parallel context, `Trainer.start()` resumes from the
latest checkpoint, `Trainer.train()` is the loop and `Trainer.iterate()` one pass of it (the benchmark
drives it step by step). Every rank runs the same control flow: the loss is known on every rank and the
gradient norm is global, so the stability guard decides the same thing everywhere and no rank is left
waiting in a collective the others skipped.

Iterations count from 1: the step that takes the model from iteration k-1 to k is "iteration k" in the
console, the metrics file and `--inject-fault KIND@k`.

`Trainer.phase` names the work in progress and the process groups it talks to; the launcher prints it
when a collective fails (a dead or stuck peer), so the one error line says where the job was.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from engine import checkpoint
from engine.config import model_dtype
from engine.data import RampupBatchSize, build_datasets, make_batch, samples_before
from engine.data.sampler import rank_microbatches
from engine.metrics import MetricsWriter, format_log_line, peak_memory_gb, peak_tflops, throughput
from engine.optim import RampupBatchSize as SampleRampup
from engine.optim import build_optimizer, global_batch_size_at, lr_at, schedule_position
from engine.optim.optimizer import StepResult
from engine.pipeline import schedules
from engine.pipeline.partition import build_model_chunks
from engine.preemption import PreemptionHandler
from engine.stability import ROLLBACK, SKIP, SPIKE, SpikeGuard, corrupt_batch, parse_faults, poison_loss


def resolve_vocab_size(cfg) -> int:
    if cfg.data.tokenizer_model and not cfg.data.mock_data:
        from engine.data import Tokenizer
        return Tokenizer(cfg.data.tokenizer_model).vocab_size
    return cfg.model.vocab_size or 256


class Trainer:
    def __init__(self, cfg, ctx, device, log=print):
        self.cfg, self.ctx, self.device, self.log = cfg, ctx, device, log
        # First, so that a pre-emption signal during the (slow) set-up stops the run instead of killing it.
        self.preemption = PreemptionHandler(cfg.checkpoint.exit_duration_in_mins, device=device)
        tr = cfg.training
        self.phase = "building the model and optimizer"
        self.vocab_size = resolve_vocab_size(cfg)
        self.dtype = model_dtype(cfg)
        self.chunks = build_model_chunks(cfg, ctx, vocab_size=self.vocab_size, device=device, dtype=self.dtype)
        self.optimizer = build_optimizer(cfg, self.chunks, ctx)
        self.gbs = tr.global_batch_size or tr.micro_batch_size * ctx.dp_size
        self.ramp = SampleRampup.from_config(tr, ctx.dp_size)  # None without --rampup-batch-size
        self.batch_size = (RampupBatchSize(*tr.rampup_batch_size, self.gbs) if tr.rampup_batch_size else self.gbs)
        seq = cfg.model.seq_length
        self.shape = (seq // ctx.tp_size if ctx.sequence_parallel else seq, tr.micro_batch_size, cfg.model.hidden_size)
        self.phase = "building the datasets"
        train_samples = samples_before(tr.train_iters, self.batch_size)
        if cfg.stability.spike_rollback_after:
            # A rollback skips the data it was on instead of replaying it: room for one run's worth of skips.
            train_samples *= 2
        eval_runs = (tr.train_iters // cfg.logging.eval_interval + 1) if cfg.logging.eval_interval else 0
        self.train_ds, self.valid_ds, _ = build_datasets(
            cfg, train_samples, eval_runs * cfg.logging.eval_iters * self.gbs, 0)
        self.guard = SpikeGuard.from_config(cfg.stability)
        self.faults = parse_faults(cfg.stability.inject_fault)
        self.iteration, self.consumed, self.skipped = 0, 0, 0
        self.trace = [] if cfg.logging.pipeline_trace else None
        self.save_dir = cfg.checkpoint.save
        self.peak = peak_tflops(cfg, torch.device(device))
        self.metrics = self.profiler = None
        self.profiled = False
        self.last_record = None  # the latest training record (for callers that drive iterate())
        self.phase = "built; not started"

    def start(self) -> None:
        """Resume from the latest checkpoint if there is one and open the metrics.

        Separate from the constructor so that a failure while loading shows in `phase`. `train()` calls it
        when the caller has not.
        """
        self.resume()
        self.metrics = MetricsWriter(self.cfg, self.ctx.rank, start_iteration=self.iteration)
        self.phase = "started"

    # ------------------------------------------------------------------ state
    def checkpoint_source(self):
        """Where to resume from: --save when it holds a checkpoint (a restarted job), else --load."""
        if self.save_dir and checkpoint.latest_iteration(self.save_dir) is not None:
            return self.save_dir
        load = self.cfg.checkpoint.load
        return load if load and checkpoint.latest_iteration(load) is not None else None

    def _load(self, load_dir, load_optim: bool):
        self.phase = f"loading the checkpoint in {load_dir} (all ranks)"
        extra = checkpoint.load_checkpoint(load_dir, self.chunks, self.optimizer, self.ctx, self.cfg,
                                           fallback=self.cfg.checkpoint.ckpt_fallback, load_optim=load_optim)
        if extra is not None:
            self.iteration, self.consumed = extra["iteration"], extra["consumed_samples"]
        return extra

    def resume(self) -> bool:
        load_dir = self.checkpoint_source()
        extra = self._load(load_dir, not self.cfg.checkpoint.no_load_optim) if load_dir else None
        if extra is None:
            return False
        self.skipped = extra.get("skipped", 0)
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
        self.log(f"resumed from {load_dir} at iteration {self.iteration} ({self.consumed} samples consumed)")
        return True

    def save(self) -> None:
        self.phase = f"saving the checkpoint of iteration {self.iteration} (all ranks)"
        extra = {"consumed_samples": self.consumed, "skipped": self.skipped, "guard": self.guard.state_dict(),
                 "data": {"consumed_samples": self.consumed}}
        checkpoint.save_checkpoint(self.save_dir, self.iteration, self.chunks, self.optimizer, self.ctx, self.cfg,
                                   extra, async_save=self.cfg.checkpoint.async_save)

    def rollback(self) -> None:
        """Reload the newest checkpoint, skip the data the spike came from, lower the LR for a while.

        The live guard and skip count are kept (not the checkpoint's): they record what happened.
        """
        spike_iteration, spike_consumed = self.iteration, self.consumed
        checkpoint.finalize_async()
        load_dir = self.checkpoint_source()
        # --no-load-optim is about how the run started; going back within the run restores everything
        if load_dir is None or self._load(load_dir, load_optim=True) is None:
            self.metrics.log_event(spike_iteration, "rollback_impossible", reason="no checkpoint to roll back to")
            self.log(f"iteration {spike_iteration}: rollback requested but no checkpoint exists; continuing")
            return
        self.guard.rolled_back(self.iteration)
        self.consumed = spike_consumed  # the batches since the checkpoint are not replayed
        lr_until = self.iteration + self.guard.lr_steps
        self.metrics.log_event(spike_iteration, "rollback", resumed_iteration=self.iteration,
                               skipped_to_samples=spike_consumed, lr_factor=self.guard.lr_factor,
                               lr_factor_until_iteration=lr_until, rollbacks=self.guard.rollbacks)
        self.log(f"iteration {spike_iteration}: rolled back to the checkpoint of iteration {self.iteration}; "
                 f"data skipped to sample {spike_consumed}; LR x{self.guard.lr_factor} through iteration {lr_until}")

    # ------------------------------------------------------------------ one step
    def microbatches(self, dataset, start: int, global_batch: int) -> list:
        """This dp rank's microbatches of the global batch made of samples [start, start + global_batch)."""
        indices = rank_microbatches(start, global_batch, self.cfg.training.micro_batch_size, self.ctx.dp_rank,
                                    self.ctx.dp_size)
        return [make_batch(dataset, idx, device=self.device) for idx in indices]

    def global_batch(self) -> int:
        """The global batch size at the current data position (it grows with consumed samples under ramp-up)."""
        return global_batch_size_at(self.consumed, self.gbs, self.ramp)

    def train_step(self):
        """Forward-backward over this iteration's microbatches, grad reduction, optimizer step.

        A non-finite loss skips the optimizer step outright (the gradients cannot be trusted even when
        their norm is finite); a non-finite gradient norm makes the optimizer skip it.
        """
        ctx = self.ctx
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
        self.phase = (f"forward/backward schedule of iteration {self.iteration + 1} (pipeline send/recv in pp "
                      f"group {ctx.pp_ranks}, tensor-parallel collectives in tp group {ctx.tp_ranks})")
        events = [] if self.trace is not None else None
        loss = schedules.run(self.chunks, mbs, ctx, shape=self.shape, dtype=self.dtype, device=self.device,
                             scale_loss=scale, trace=events)
        if events is not None:
            self.trace += [(self.iteration + 1, *e) for e in events]
        self.phase = f"gradient reduction of iteration {self.iteration + 1} (dp group {ctx.dp_ranks})"
        self.optimizer.finish_grad_sync()
        if fault == "nan":
            loss = float("nan")
        # Under batch ramp-up the schedule advances in samples (Megatron-LM): consumed / final batch size.
        position = schedule_position(self.consumed, self.gbs) if self.ramp else self.iteration
        lr = lr_at(position, self.cfg.optim, self.cfg.training.train_iters) * \
            self.guard.lr_multiplier(self.iteration + 1)
        self.phase = (f"optimizer step of iteration {self.iteration + 1} (grad-norm all-reduce over the model's "
                      f"groups, parameter all-gather in dp group {ctx.dp_ranks})")
        if math.isfinite(loss):
            result = self.optimizer.step(lr)
        else:
            result = StepResult(False, float("nan"), self.optimizer.scaler.scale)
        self.iteration += 1
        self.consumed += gbs
        return loss, lr, result, gbs

    @torch.no_grad()
    def evaluate(self) -> float:
        ctx = self.ctx
        self.phase = (f"evaluation at iteration {self.iteration} (pipeline send/recv in pp group {ctx.pp_ranks}, "
                      f"tp group {ctx.tp_ranks}, dp group {ctx.dp_ranks})")
        for model in self.chunks:
            model.eval()
        lg = self.cfg.logging
        losses, start = [], (self.iteration // lg.eval_interval - 1) * lg.eval_iters * self.gbs
        for i in range(lg.eval_iters):
            mbs = self.microbatches(self.valid_ds, (start + i * self.gbs) % max(len(self.valid_ds) - self.gbs + 1, 1),
                                    self.gbs)
            losses.append(schedules.run(self.chunks, mbs, ctx, shape=self.shape, dtype=self.dtype,
                                        device=self.device, forward_only=True))
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ the loop
    def iterate(self) -> bool:
        """One iteration: step, stability guard, metrics, then roll back or evaluate and save as due.

        Returns False when the run must stop now (pre-emption signal or --exit-duration-in-mins).
        """
        cfg = self.cfg
        tr, lg, ck = cfg.training, cfg.logging, cfg.checkpoint
        self._profile_start()
        start = time.time()
        loss, lr, result, gbs = self.train_step()
        decision = self.guard.check(self.iteration, loss, result.grad_norm)
        self.phase = f"pre-emption check after iteration {self.iteration} (all-reduce over all ranks)"
        stop = self.preemption.should_stop()
        seconds = time.time() - start
        self._report(decision, loss, result)
        record = {"iteration": self.iteration, "train_iters": tr.train_iters, "consumed_samples": self.consumed,
                  "consumed_tokens": self.consumed * cfg.model.seq_length, "lm_loss": loss, "lr": lr,
                  "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": self.skipped,
                  "spikes": self.guard.spikes, "rollbacks": self.guard.rollbacks,
                  "mem_peak_gb": peak_memory_gb(torch.device(self.device))}
        record.update(throughput(cfg, gbs, seconds, self.ctx.world_size, self.peak))
        self.metrics.log_train(record)
        self.last_record = record
        if self.iteration % lg.log_interval == 0:
            self.log(format_log_line(record))
        self._profile_stop()
        if decision.kind == ROLLBACK:
            self.rollback()
        elif lg.eval_interval and self.iteration % lg.eval_interval == 0 and self.valid_ds is not None:
            vloss = self.evaluate()
            self.metrics.log_valid(self.iteration, vloss)
            self.log(f"validation at iteration {self.iteration}: loss {vloss:.4f} ppl {math.exp(min(vloss, 20)):.2f}")
        due = ck.save_interval and self.iteration % ck.save_interval == 0
        if self.save_dir and (due or stop) and checkpoint.latest_iteration(self.save_dir) != self.iteration:
            self.save()  # (after a rollback the iteration reached is the checkpoint's: no re-save)
        if stop:
            saved = "; checkpoint saved" if self.save_dir else "; no --save, nothing saved"
            self.log(f"stopping at iteration {self.iteration}: {self.preemption.reason}{saved}")
        return not stop

    def _report(self, decision, loss: float, result) -> None:
        """Count and log what the guard decided (every rank decides the same; rank 0 writes)."""
        if not result.updated or decision.kind == SKIP:
            self.skipped += 1
            reason = "non-finite loss" if not math.isfinite(loss) else "non-finite gradient norm"
            self.metrics.log_event(self.iteration, "skip", reason=reason, loss=loss, grad_norm=result.grad_norm,
                                   skipped=self.skipped)
            self.log(f"iteration {self.iteration}: step skipped ({reason}); {self.skipped} skipped so far")
        elif decision.kind in (SPIKE, ROLLBACK):
            self.metrics.log_event(self.iteration, "spike", **decision.info)
            self.log(f"iteration {self.iteration}: loss spike {loss:.4f} above {decision.info['threshold']:.4f} "
                     f"({decision.info['spikes_in_window']} in the window)")
        if self.guard.lr_multiplier(self.iteration) == 1.0 and self.guard.lr_multiplier(self.iteration - 1) != 1.0:
            self.metrics.log_event(self.iteration, "lr_restored")
            self.log(f"iteration {self.iteration}: the lowered LR period after the rollback is over")

    def train(self) -> None:
        cfg = self.cfg
        if self.metrics is None:
            self.start()
        while self.iteration < cfg.training.train_iters and self.iterate():
            pass
        if self.save_dir and self.iteration == cfg.training.train_iters and \
                checkpoint.latest_iteration(self.save_dir) != self.iteration:
            self.save()
        self.phase = "finishing the last asynchronous checkpoint save"
        checkpoint.finalize_async()
        self._profile_stop(force=True)
        self.write_trace()
        self.metrics.close()
        self.preemption.restore()
        self.phase = "tearing down"

    # ------------------------------------------------------------------ profiling and traces
    def _profile_start(self) -> None:
        """Start torch.profiler before the step numbered --profile-step-start (or later, on a resumed run)."""
        lg = self.cfg.logging
        if not lg.profile or self.profiler is not None or self.profiled:
            return
        if lg.profile_step_start <= self.iteration + 1 <= lg.profile_step_end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.device(self.device).type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()

    def _profile_stop(self, force: bool = False) -> None:
        """After --profile-step-end: write the trace (one file per rank) into --tensorboard-dir."""
        if self.profiler is None or not (force or self.iteration >= self.cfg.logging.profile_step_end):
            return
        self.profiler.stop()
        out = self.cfg.logging.tensorboard_dir
        torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{self.ctx.rank}")(self.profiler)
        self.profiler, self.profiled = None, True
        first = self.cfg.logging.profile_step_start
        self.log(f"profiler trace of iterations {first}-{self.iteration} written to {out}")

    def write_trace(self) -> None:
        if self.trace is None:
            return
        path = f"{self.cfg.logging.pipeline_trace}.rank{self.ctx.rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            for iteration, rank, pp_rank, kind, mb, chunk, t0, t1 in self.trace:
                fh.write(json.dumps({"iteration": iteration, "rank": rank, "pp_rank": pp_rank, "kind": kind,
                                     "microbatch": mb, "chunk": chunk, "start": t0, "end": t1}) + "\n")

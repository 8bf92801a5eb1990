"""The training loop: get batch, forward-backward schedule, reduce grads, step, log, evaluate, save.

`Trainer` builds everything from the config and the parallel context, `Trainer.start()` resumes from the
latest checkpoint, `Trainer.train()` is the loop and `Trainer.iterate()` one pass of it (the benchmark
drives it step by step). Every rank runs the same control flow: the loss is known on every rank and the
gradient norm is global, so the stability guard decides the same thing everywhere and no rank is left
waiting in a collective the others skipped.

Iterations count from 1: the step from iteration k-1 to k is "iteration k" in the console, the metrics
and `--inject-fault KIND@k`. Side concerns live beside the loop: fault drills and the spike guard
(stability.py), the profiler, the pipeline trace, checkpoint I/O (checkpoint.Checkpointer) and `phase`,
the work in progress that the launcher names when a collective fails.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from engine.checkpoint import Checkpointer
from engine.checkpoint.resume import check_resumed
from engine.config import model_dtype, resolve
from engine.data import BatchSampler, BatchSizeSchedule, build_datasets, make_batch
from engine.metrics import MetricsWriter, peak_memory_gb, peak_tflops, perplexity, save_report, throughput
from engine.optim import StepResult, build_optimizer
from engine.optim.post_validation import PostValidator
from engine.optim.schedule import lr_at_sample
from engine.phase import Phase
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.pipeline.schedules import SPLIT_BACKWARD
from engine.pipeline.trace import PipelineTrace
from engine.preemption import PreemptionHandler
from engine.profiling import StepProfiler
from engine.stability import ROLLBACK, FaultDrill, SpikeGuard


@dataclass
class Outcome:
    """An iteration as the stability guard and the metrics see it."""
    iteration: int
    consumed: int  # samples consumed after it
    loss: float
    lr: float
    result: Optional[StepResult]
    global_batch: int


class Trainer:
    def __init__(self, cfg, ctx, device, log=print):
        self.cfg, self.ctx, self.device, self.log = cfg, ctx, device, log
        # First, so that a pre-emption signal during the (slow) set-up stops the run instead of killing it.
        self.preemption = PreemptionHandler(cfg.checkpoint.exit_duration_in_mins, device=device,
                                            exit_interval=cfg.checkpoint.exit_interval)
        self.phase = Phase(ctx, "building the model and optimizer")
        tr, m = resolve(cfg, ctx.world_size).training, cfg.model
        self.dtype = model_dtype(cfg)
        self.chunks = build_model_chunks(cfg, ctx, device=device, dtype=self.dtype)
        self.optimizer = build_optimizer(cfg, self.chunks, ctx)
        self.trace = PipelineTrace(ctx.rank, ctx.pp_rank) if cfg.logging.pipeline_trace else None
        self.pipeline = PipelineRunner.from_config(cfg, self.chunks, ctx, self.dtype, device, self.trace)
        self.batch_sizes = BatchSizeSchedule.from_config(tr)
        self.sampler = BatchSampler(self.batch_sizes, tr.micro_batch_size, ctx.dp_rank, ctx.dp_size)
        self.guard = SpikeGuard.from_config(cfg.stability)
        self.drill = FaultDrill.from_config(cfg.stability, m.vocab_size)
        self.phase.text = "building the datasets"
        self.train_ds, self.valid_ds = self._datasets()
        self.checkpointer = Checkpointer(cfg, ctx)
        self.profiler = StepProfiler(cfg.logging, ctx.rank, device, log)
        self.peak = peak_tflops(cfg, torch.device(device))
        self.iteration, self.metrics, self.last_record = 0, None, None
        # Zero-bubble schedules step without waiting for the other stages (engine.optim.post_validation).
        self.validator = PostValidator(self.optimizer, ctx) \
            if cfg.pipeline_schedule in SPLIT_BACKWARD and ctx.pp_size > 1 else None
        self.pending: Optional[Outcome] = None  # the iteration whose step awaits its check
        self.asked_to_stop, self.step_seconds = False, 0.0
        self.phase.text = "built; not started"

    def _datasets(self) -> tuple:
        tr, lg = self.cfg.training, self.cfg.logging
        train = self.batch_sizes.samples_before(tr.train_iters) * self.guard.data_headroom
        evaluations = (tr.train_iters // lg.eval_interval + 1) if lg.eval_interval else 0
        return build_datasets(self.cfg, train, evaluations * lg.eval_iters * tr.global_batch_size, 0, self.log)[:2]

    @property
    def consumed(self) -> int:
        return self.sampler.consumed_samples

    def start(self) -> None:
        """Resume from the latest checkpoint if there is one and open the metrics (separate from the
        constructor so that a failure while loading shows in `phase`; `train()` calls it if needed)."""
        self.resume()
        self.metrics = MetricsWriter(self.cfg, self.ctx.rank, start_iteration=self.iteration)
        self.phase.text = "started"

    # ------------------------------------------------------------------ checkpoints
    def _load(self, point, load_optim: bool) -> Optional[dict]:
        with self.phase(f"loading the checkpoint in {point.directory}", "all"):
            extra = point.start(self.checkpointer.load(point.directory, self.chunks, self.optimizer,
                                                       load_optim and not point.finetune, point.iteration))
        if extra is not None:
            self.iteration = extra["iteration"]
            self.sampler.load_state_dict(extra.get("data") or {"consumed_samples": extra["consumed_samples"]})
        return extra

    def resume(self) -> bool:
        """Load where resume.py says (own --save, else --load, else --pretrained-checkpoint); check it may go on."""
        with self.phase("deciding where to resume from", "all"):
            point = self.checkpointer.resume_point(self.log)
        extra = self._load(point, not self.cfg.checkpoint.no_load_optim) if point else None
        if extra is None:
            return False
        check_resumed(self.cfg, point.directory, self.iteration, extra["config"], self.log, extra.get("finetune"))
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
        self.log(f"resumed from {point.directory} at iteration {self.iteration} ({self.consumed} samples consumed)")
        return True

    def save(self) -> None:
        extra = {"consumed_samples": self.consumed, "guard": self.guard.state_dict(), "data": self.sampler.state_dict()}
        with self.phase(f"saving the checkpoint of iteration {self.iteration}", "all"), \
                save_report(self.checkpointer, self.iteration, self.log):  # "saving ..." and "saved ... in X s"
            self.checkpointer.save(self.iteration, self.chunks, self.optimizer, extra)

    def rollback(self) -> None:
        """Reload the newest checkpoint, skip the data the spike came from, lower the LR for a while.

        The live guard is kept (not the checkpoint's): its counts record what happened.
        """
        spike_iteration, spike_consumed = self.iteration, self.consumed
        if self.validator is not None:
            self.validator.drop()  # the checkpoint replaces what the step in flight changed
            self.pending = None
        point = self.checkpointer.resume_point()
        # --no-load-optim is about how the run started; going back within the run restores everything
        if point is None or self._load(point, load_optim=True) is None:
            return self._report(spike_iteration, self.guard.rollback_events(spike_iteration, None, spike_consumed))
        self.guard.rolled_back(self.iteration)
        self.sampler.load_state_dict({"consumed_samples": spike_consumed})  # the batches since are not replayed
        self._report(spike_iteration, self.guard.rollback_events(spike_iteration, self.iteration, spike_consumed))

    def _report(self, iteration: int, events: list) -> None:
        """Metrics events and console lines: (kind, fields, line) each, as the stability guard words them."""
        for kind, info, line in events:
            self.metrics.log_event(iteration, kind, **info)
            self.log(line)

    # ------------------------------------------------------------------ one step
    def _tensors(self, dataset, microbatches: list) -> list:
        return [make_batch(dataset, ids, device=self.device) for ids in microbatches]

    def train_step(self) -> list:
        """Forward-backward over this iteration's microbatches, grad reduction, optimizer step (or its skip).

        Returns the outcomes known now: this iteration's, or under post-validation the previous one's (none
        on the first), settled before this one steps; the trainer accounts for them in that order."""
        n, tr = self.iteration + 1, self.cfg.training
        position = self.batch_sizes.lr_samples(self.consumed, self.iteration)  # Megatron-LM's unit: samples
        lr = lr_at_sample(position, self.cfg.optim, tr) * self.guard.lr_multiplier(n)
        gbs = self.sampler.batch_size
        mbs, scale_loss = self.drill.arm(n, self._tensors(self.train_ds, next(self.sampler)), self.optimizer.scale_loss)
        for model in self.chunks:
            model.train()
        if self.validator is None:
            loss = self._forward_backward(n, mbs, scale_loss)
            with self.phase(f"optimizer step of iteration {n}", "tp", "pp", "dp"):
                result = self.optimizer.step(lr, loss_is_finite=math.isfinite(loss))
            self.iteration = n
            return [Outcome(n, self.consumed, loss, lr, result, gbs)]
        share = self._forward_backward(n, mbs, scale_loss)
        done, rerun = self._settle()
        if rerun:  # the previous step was redone (or the loss scale moved): these gradients used stale weights
            self.log(f"iteration {n - 1}: optimizer step redone after its check ({rerun}); iteration {n} runs its "
                     "forward and backward again")
            share = self._forward_backward(n, mbs, scale_loss)
        with self.phase(f"optimizer step of iteration {n} (validated during the next)", "dp"):
            self.validator.speculate(lr, [share, float(self.preemption.asked())])
        self.pending = Outcome(n, self.consumed, math.nan, lr, None, gbs)
        self.iteration = n
        return done

    def _forward_backward(self, n: int, mbs: list, scale_loss):
        """The schedule's forwards and backwards and the gradient reduction; the loss (known everywhere), or
        under post-validation this rank's share of it."""
        self.optimizer.start_step(len(mbs))
        if self.trace is not None:
            self.trace.iteration = n
        with self.phase(f"forward/backward schedule of iteration {n}", "pp", "tp"):
            loss = self.drill.reported_loss(self.pipeline.run(mbs, scale_loss=scale_loss,
                                                              shared=self.validator is None))
        with self.phase(f"gradient reduction of iteration {n}", "dp"):
            self.optimizer.finish_grad_sync()
        return loss

    def _settle(self) -> tuple:
        """Post-validation: wait for the pending step's check and keep or redo it; ([its outcome] or [], why the
        step in progress must run again, or "")."""
        if self.validator is None or self.pending is None:
            return [], ""
        with self.phase(f"checking the optimizer step of iteration {self.pending.iteration}", "all"):
            settled = self.validator.settle()
        outcome, self.pending = self.pending, None
        outcome.loss, outcome.result = settled.shares[0], settled.result
        self.asked_to_stop = settled.shares[1] > 0
        return [outcome], settled.why if settled.rerun else ""

    @torch.no_grad()
    def evaluate(self) -> float:
        lg, gbs = self.cfg.logging, self.cfg.training.global_batch_size
        for model in self.chunks:
            model.eval()
        start = (self.iteration // lg.eval_interval - 1) * lg.eval_iters * gbs
        span = max(len(self.valid_ds) - gbs + 1, 1)
        with self.phase(f"evaluation at iteration {self.iteration}", "pp", "tp", "dp"):
            losses = [self.pipeline.run(self._tensors(self.valid_ds, self.sampler.microbatches_of(
                (start + i * gbs) % span, gbs)), forward_only=True) for i in range(lg.eval_iters)]
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ the loop
    def iterate(self) -> bool:
        """One iteration: step, stability guard, metrics, then roll back or evaluate and save as due.

        Returns False when the run must stop now (pre-emption signal or --exit-duration-in-mins).
        """
        lg, ck = self.cfg.logging, self.cfg.checkpoint
        with self.profiler.step(self.iteration + 1):
            start = time.time()
            outcomes = self.train_step()
            with self.phase(f"pre-emption check after iteration {self.iteration}", "all"):
                stop = self.preemption.should_stop(self.iteration) if self.validator is None else \
                    self.preemption.decide(self.asked_to_stop, self.iteration)  # flags of the step just settled
            with self.phase(f"checking the checkpoint save in flight after iteration {self.iteration}", "all"):
                self.checkpointer.check_in_flight()
            self.step_seconds = time.time() - start
            rolled_back = self._account(outcomes, self.step_seconds)
        evaluate = lg.eval_interval and self.iteration % lg.eval_interval == 0 and self.valid_ds is not None
        due = ck.save_interval and self.iteration % ck.save_interval == 0
        if not rolled_back and (evaluate or (ck.save and (due or stop))):
            rolled_back = self._account(self._settle()[0], time.time() - start)  # weights as they will stay
        if not rolled_back and evaluate:
            loss = self.evaluate()
            self.metrics.log_valid(self.iteration, loss)
            self.log(f"validation at iteration {self.iteration}: loss {loss:.4f} ppl {perplexity(loss):.2f}")
        if ck.save and (due or stop) and self.checkpointer.latest(ck.save) != self.iteration:
            self.save()  # (after a rollback the iteration reached is the checkpoint's: no re-save)
        if stop:
            saved = f"; checkpoint saved in {ck.save}; to resume, run the same command (it resumes from --save)" \
                if ck.save else "; no --save, nothing saved"
            self.log(f"stopping at iteration {self.iteration}: {self.preemption.reason}{saved}")
        return not stop

    def _account(self, outcomes: list, seconds: float) -> bool:
        """Stability guard, metrics and reports for each settled iteration; True when the guard rolled back."""
        for o in outcomes:
            decision = self.guard.check(o.iteration, o.loss, o.result.grad_norm)
            self.last_record = self._record(o, seconds)
            if (line := self.metrics.log_train(self.last_record)) is not None:  # every --log-interval iterations
                self.log(line)
            self._report(o.iteration, self.guard.events(decision, o.iteration))
            if decision.kind == ROLLBACK:
                self.rollback()
                return True
        return False

    def _record(self, o: "Outcome", seconds: float) -> dict:
        """The metrics file's training record of a settled iteration."""
        g, m, mem, ctx, result = self.guard, self.cfg.model, peak_memory_gb(torch.device(self.device)), self.ctx, \
            o.result
        record = {"iteration": o.iteration, "train_iters": self.cfg.training.train_iters,
                  "consumed_samples": o.consumed, "consumed_tokens": o.consumed * m.seq_length, "lm_loss": o.loss,
                  "lr": o.lr, "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": g.skipped,
                  "spikes": g.spikes, "rollbacks": g.rollbacks, "mem_peak_gb": mem} | result.metrics
        return record | throughput(m, o.global_batch, seconds, ctx.world_size, ctx.tp_size, self.peak)

    def train(self) -> None:
        cfg, save = self.cfg, self.cfg.checkpoint.save
        if self.metrics is None:
            self.start()
        while self.iteration < cfg.training.train_iters and self.iterate():
            pass
        self._account(self._settle()[0], self.step_seconds)  # a step still pending (post-validation), if any
        if save and self.iteration == cfg.training.train_iters and self.checkpointer.latest(save) != self.iteration:
            self.save()
        with self.phase("finishing the last asynchronous checkpoint save", "all"):
            self.checkpointer.finalize()
        self.profiler.close(self.iteration)
        if self.trace is not None:
            self.trace.write(cfg.logging.pipeline_trace)
        self.metrics.close()
        self.preemption.restore()
        self.phase.text = "tearing down"

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

import time
from typing import Optional

import torch

from engine.checkpoint import Checkpointer
from engine.data import BatchSampler, BatchSizeSchedule, build_datasets, make_batch
from engine.metrics import MetricsWriter, peak_tflops, perplexity, save_report, train_record
from engine.optim import build_optimizer
from engine.optim.schedule import rates_at_sample
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.pipeline.trace import PipelineTrace
from engine.precision import model_dtype
from engine.resolve import check_resumed, resolve
from engine.run.phase import Phase
from engine.run.preemption import PreemptionHandler
from engine.run.profiling import StepProfiler
from engine.stability import ROLLBACK, FaultDrill, SpikeGuard
from engine.stepping import Stepper


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
        self.iteration, self.metrics, self.last_record, self.step_seconds = 0, None, None, 0.0
        self.stepper = Stepper(cfg, ctx, self.optimizer, self.pipeline, self.drill, self.preemption, self.phase,
                               self.trace, log)
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
        moved = f", resharded from {extra['saved_layout']} (fresh RNG streams)" if "saved_layout" in extra else ""
        self.log(f"resumed from {point.directory} at iteration {self.iteration} ({self.consumed} samples consumed){moved}")
        return True

    def save(self) -> None:
        extra = {"consumed_samples": self.consumed, "guard": self.guard.state_dict(), "data": self.sampler.state_dict()}
        with self.phase(f"saving the checkpoint of iteration {self.iteration}", "all"), \
                save_report(self.checkpointer, self.iteration, self.log):  # "saving ..." and "saved ... in X s"
            self.checkpointer.save(self.iteration, self.chunks, self.optimizer, extra)

    def rollback(self, spike_iteration: int, spike_consumed: int) -> None:
        """Reload the newest checkpoint, skip the batch of the iteration that spiked (under post-validation the next
        one, already running, replays), lower the LR for a while. The live guard is kept: its counts record it."""
        point = self.checkpointer.resume_point()
        if point is not None:
            self.stepper.drop()  # the checkpoint replaces what a step in flight changed
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
        """Forward-backward, grad reduction, optimizer step (or its skip); the outcomes known now, in order
        (engine.stepping: this iteration's, or under post-validation the previous one's)."""
        n, tr = self.iteration + 1, self.cfg.training
        position = self.batch_sizes.lr_samples(self.consumed, self.iteration)  # Megatron-LM's unit: samples
        lr = rates_at_sample(position, self.cfg.optim, tr, self.guard.lr_multiplier(n))
        gbs = self.sampler.batch_size
        mbs, scale_loss = self.drill.arm(n, self._tensors(self.train_ds, next(self.sampler)), self.optimizer.scale_loss)
        for model in self.chunks:
            model.train()
        outcomes = self.stepper.step(n, lr, self.consumed, gbs, mbs, scale_loss)
        self.iteration = n
        return outcomes

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
                stop = self.stepper.should_stop(self.iteration)
            with self.phase(f"checking the checkpoint save in flight after iteration {self.iteration}", "all"):
                self.checkpointer.check_in_flight()
            self.step_seconds = time.time() - start
            rolled_back = self._account(outcomes, self.step_seconds)
        evaluate = lg.eval_interval and self.iteration % lg.eval_interval == 0 and self.valid_ds is not None
        due = ck.save_interval and self.iteration % ck.save_interval == 0
        if not rolled_back and (evaluate or (ck.save and (due or stop))):
            rolled_back = self._account(self.stepper.settle(), time.time() - start)  # weights as they will stay
        if not rolled_back and evaluate:
            loss = self.evaluate()
            self.metrics.log_valid(self.iteration, loss)
            self.log(f"validation at iteration {self.iteration}: loss {loss:.4f} ppl {perplexity(loss):.2f}")
        if ck.save and (due or stop) and self.checkpointer.latest(ck.save) != self.iteration:
            self.save()  # (after a rollback the iteration reached is the checkpoint's: no re-save)
        if stop:
            if ck.save:  # an async save on disk (and said so) before the stop line
                self.checkpointer.finalize()
            saved = f"; checkpoint saved in {ck.save}; to resume, run the same command (it resumes from --save)" \
                if ck.save else "; no --save, nothing saved"
            self.log(f"stopping at iteration {self.iteration}: {self.preemption.reason}{saved}")
        return not stop

    def _account(self, outcomes: list, seconds: float) -> bool:
        """Stability guard, metrics and reports for each settled iteration; True when the guard rolled back."""
        for o in outcomes:
            decision = self.guard.check(o.iteration, o.loss, o.result.grad_norm)
            self.last_record = train_record(o, self.guard, self.cfg, self.ctx, self.device, self.peak, seconds)
            if (line := self.metrics.log_train(self.last_record)) is not None:  # every --log-interval iterations
                self.log(line)
            self._report(o.iteration, self.guard.events(decision, o.iteration))
            if decision.kind == ROLLBACK:
                self.rollback(o.iteration, o.consumed)
                return True
        return False

    def train(self) -> None:
        cfg, save = self.cfg, self.cfg.checkpoint.save
        if self.metrics is None:
            self.start()
        while self.iteration < cfg.training.train_iters and self.iterate():
            pass
        self._account(self.stepper.settle(), self.step_seconds)  # a step still pending (post-validation), if any
        self.optimizer.wait_weights()  # the last step's all-gathers (--overlap-param-gather under ZeRO-1/2)
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

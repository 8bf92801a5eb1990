"""One training step as the loop sees it: forward-backward, gradient reduction and the optimizer step, either
synchronous (every rank waits for the global norm, then steps) or, under the zero-bubble schedules,
post-validated (engine.optim.post_validation: step now, checked during the next iteration, which runs again
when the check redoes the step). Either way the loop gets `Outcome`s in iteration order: synchronous steps
report their own, post-validated ones the previous iteration's, and `settle()` the one still pending. Once the
gradients are reduced, the MoE routing statistics are summed and the expert biases moved (engine.moe.stats;
Megatron-LM does this in its finalize step). With packed documents the step's attention pairs, counted by each
replica's pipeline runner, are summed over the data-parallel replicas for the FLOP count (engine.flops)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from engine import fp8
from engine.moe.stats import MoEStats
from engine.mtp import MTPStats
from engine.parallel import comm
from engine.optim.optimizer import StepResult
from engine.optim.post_validation import PostValidator


@dataclass
class Outcome:
    """An iteration as the stability guard and the metrics see it."""
    iteration: int
    consumed: int  # samples consumed after it
    loss: float
    lr: float
    result: Optional[StepResult]
    global_batch: int
    routing: dict  # the MoE routing statistics (engine.moe.stats) and MTP loss (engine.mtp) of its step, or {}
    pairs: Optional[int] = None  # its attention pairs over the global batch (packed documents), else None


class Stepper:
    def __init__(self, cfg, ctx, optimizer, pipeline, drill, preemption, phase, trace=None, log=print):
        self.optimizer, self.pipeline, self.drill, self.preemption = optimizer, pipeline, drill, preemption
        self.ctx, self.pairs = ctx, None  # the attention pairs of the last step run (packed documents)
        self.phase, self.trace, self.log = phase, trace, log
        self.validator = PostValidator(optimizer, ctx) if ctx.layout.schedule.split_backward else None
        self.stats = [stats(cfg, pipeline.chunks, ctx, pipeline.device) for stats, wanted in
                      ((MoEStats, cfg.model.num_experts), (MTPStats, cfg.model.mtp_num_layers)) if wanted]
        self.fp8_delayed = fp8.delayed(pipeline.chunks)  # the amax histories move once per step
        self.routing: dict = {}  # the statistics of the last gradient reduction
        self.pending: Optional[Outcome] = None  # the iteration whose step awaits its check
        self.asked_to_stop = False  # the pre-emption flags of the step settled last, summed over every rank

    def step(self, n: int, lr: float, consumed: int, global_batch: int, mbs: list, scale_loss) -> list:
        """Run iteration `n`; returns the outcomes known now (see the module doc)."""
        if self.validator is None:
            loss = self._forward_backward(n, mbs, scale_loss)
            with self.phase(f"optimizer step of iteration {n}", "tp", "pp", "dp"):
                result = self.optimizer.step(lr, loss_is_finite=math.isfinite(loss))
            return [Outcome(n, consumed, loss, lr, result, global_batch, self.routing, self.pairs)]
        share = self._forward_backward(n, mbs, scale_loss)
        done, rerun = self._settle()
        if rerun:  # the previous step was redone (or the loss scale moved): these gradients used stale weights
            self.log(f"iteration {n - 1}: optimizer step redone after its check ({rerun}); iteration {n} runs its "
                     "forward and backward again, and steps wait for their check until one passes")
            share = self._forward_backward(n, mbs, scale_loss)
        with self.phase(f"optimizer step of iteration {n}", "all"):
            checked = self.validator.step(lr, [share, float(self.preemption.asked())])
        if checked is None:  # validated during the next iteration
            self.pending = Outcome(n, consumed, math.nan, lr, None, global_batch, self.routing, self.pairs)
            return done
        self.asked_to_stop = checked.shares[1] > 0
        return done + [Outcome(n, consumed, checked.shares[0], lr, checked.result, global_batch, self.routing,
                               self.pairs)]

    def should_stop(self, iteration: int) -> bool:
        """The pre-emption decision after `iteration`: a collective, or from the flags settled last."""
        if self.validator is None:
            return self.preemption.should_stop(iteration)
        return self.preemption.decide(self.asked_to_stop, iteration)

    def settle(self) -> list:
        """The pending iteration's outcome, its step kept or redone (nothing runs again), or []."""
        return self._settle()[0]

    def drop(self) -> None:
        """Forget the pending step (a checkpoint is about to replace the state)."""
        if self.validator is not None:
            self.validator.drop()
            self.pending = None

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
        if self.fp8_delayed:
            with self.phase(f"FP8 amax reduction of iteration {n}", "all"):
                fp8.finish_step(self.pipeline.chunks, self.ctx)
        if self.stats:
            with self.phase(f"MoE routing and MTP statistics of iteration {n}", "all"):
                self.routing = {k: v for stats in self.stats for k, v in stats.finish_step().items()}
        self.pairs = self._global_pairs(n)
        return loss

    def _global_pairs(self, n: int) -> Optional[int]:
        """The step's attention pairs over the global batch: each replica counted its own microbatches."""
        pairs = self.pipeline.attention_pairs
        if pairs is None or self.ctx.dp_size == 1:
            return pairs
        total = torch.tensor([pairs], dtype=torch.int64, device=self.pipeline.device)
        with self.phase(f"attention pairs of iteration {n}", "dp"):
            comm.all_reduce(total, self.ctx.dp_group)
        return int(total.item())

    def _settle(self) -> tuple:
        """([the pending outcome] or [], why the step in progress must run again, or "")."""
        if self.validator is None or self.pending is None:
            return [], ""
        with self.phase(f"checking the optimizer step of iteration {self.pending.iteration}", "all"):
            settled = self.validator.settle()
        outcome, self.pending = self.pending, None
        outcome.loss, outcome.result = settled.shares[0], settled.result
        self.asked_to_stop = settled.shares[1] > 0
        return [outcome], settled.why if settled.rerun else ""

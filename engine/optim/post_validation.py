"""Optimizer post-validation (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 4): step now, check later.

Before its optimizer step every rank normally waits for the global gradient norm (clipping, inf/nan), i.e.
for the slowest stage to finish its backward; in a zero-bubble schedule's parallelogram the last stage ends
(p - 1) F / 2 after the first, so that wait alone would be the whole bubble. Under a zero-bubble schedule
the trainer therefore steps each rank as soon as its own gradients are reduced, as if clipping were not
needed (coefficient 1) and nothing were inf/nan, and starts one all-reduce over every rank (ctx.step_group)
of its shares of the squared norm and of the loss (and any other flags), without waiting for it
(`speculate`). The next step's forward and backward run meanwhile; before that step's own update the
trainer calls `settle`, by which time every rank has long joined the all-reduce:

- the norm is finite, the loss too, and clipping would not have scaled: the step stands;
- otherwise the step is undone from the copies taken before it (masters, Adam moments, gradients) and
  redone as the synchronous path would have done it (clipped with the true coefficient, or skipped), and
  the step in progress, whose forward and backward used the wrong weights, must be run again (`rerun`).
  A changed fp16 loss scale also means a rerun (the step in progress was scaled with the old one). The
  steps after a failed check wait for their own (`step`), until one passes: a run that clips step after
  step then pays the barrier, not a second forward and backward per step.

Exact: every step applied is the one the synchronous path applies (tests/test_post_validation.py). The cost
is a copy of this rank's optimizer range (fp32 masters, two moments and the gradients, sharded under the
distributed optimizer) and, when clipping or inf/nan hits, one more forward and backward. The authors undo
the step by inverting AdamW in place instead, which saves the copy but is exact only up to rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from engine.optim import adamw
from engine.optim.clip import clip_coefficient, norm_share
from engine.optim.optimizer import Optimizer, StepResult
from engine.parallel import comm


@dataclass
class _Pending:
    lr: float
    scale: float          # the loss scale the step's gradients carry
    vector: torch.Tensor  # [squared-norm share, other shares...], summed over every rank in flight
    work: object          # that all-reduce (None on one rank)
    saved: list           # copies of optimizer.rollback_tensors() before the step
    steps: int


@dataclass
class Settled:
    result: StepResult  # the step as the synchronous path applies it
    shares: list        # the other shares, summed over every rank
    rerun: bool         # the step in progress must run its forward and backward again
    why: str = ""       # why (for the console)


class PostValidator:
    def __init__(self, optimizer: Optimizer, ctx):
        self.optimizer, self.ctx, self.pending, self.copies = optimizer, ctx, None, None
        self.cautious = False  # the last check failed: step only after the check until one passes

    def step(self, lr: float, shares: list) -> Optional[Settled]:
        """This step's update. Normally speculative (`speculate`; None: settle it later). After a check that
        failed, clipping or inf/nan tend to persist (early training clips step after step), and each
        speculative step would be redone and the next iteration run twice: until a check passes, the step
        waits for its all-reduce and is taken as the synchronous path takes it (returned settled)."""
        return self._checked(lr, shares) if self.cautious else self.speculate(lr, shares)

    def speculate(self, lr: float, shares: list) -> None:
        """Start the all-reduce of this step's norm and `shares` (tensors or floats, the loss first), copy what
        the update changes, and update as if the norm needed no clipping and nothing were inf/nan."""
        assert self.pending is None, "settle the previous step first"
        opt = self.optimizer
        vector, work = self._launch(shares)
        live = opt.rollback_tensors()
        if self.copies is None:
            self.copies = [torch.empty_like(t) for t in live]  # allocated once, refilled every step
        with torch.no_grad():
            for copy, t in zip(self.copies, live):
                copy.copy_(t)
        scale = opt.scaler.scale
        self.pending = _Pending(lr, scale, vector, work, self.copies, opt.steps)
        opt.update(lr, 1.0 / scale)

    def settle(self) -> Optional[Settled]:
        """Wait for the pending step's all-reduce; keep or redo the step (module doc). The first share is the
        loss: a non-finite one skips the step, as in Optimizer.step. None when nothing is pending."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        if p.work is not None:
            p.work.wait()
        opt = self.optimizer
        norm, shares, why = self._judge(p.vector, p.scale)
        self.cautious = bool(why)
        if not why:
            opt.scaler.update(False)
            moved = opt.scaler.scale != p.scale
            return Settled(StepResult(True, norm, opt.scaler.scale), shares, rerun=moved,
                           why="the loss scale changed" if moved else "")
        self._restore(p)
        result = opt.finish_step(p.lr, norm, p.scale) if math.isfinite(shares[0]) else \
            StepResult(False, float("nan"), p.scale)
        return Settled(result, shares, rerun=True, why=why)

    def _checked(self, lr: float, shares: list) -> Settled:
        """The synchronous step, the loss and flags riding on the norm's all-reduce."""
        opt = self.optimizer
        vector, work = self._launch(shares)
        if work is not None:
            work.wait()
        scale = opt.scaler.scale
        norm, shares, why = self._judge(vector, scale)
        self.cautious = bool(why)
        result = opt.finish_step(lr, norm, scale) if math.isfinite(shares[0]) else \
            StepResult(False, float("nan"), scale)
        return Settled(result, shares, rerun=False, why=why)

    def _launch(self, shares: list) -> tuple:
        """(vector, work): this rank's squared-norm share and `shares`, their sum over every rank started."""
        opt = self.optimizer
        device = opt.buffer.data.device
        dense, experts = opt.norm_pieces()
        sq = norm_share(dense, self.ctx, sharded_over_dp=opt.distributed, device=device, expert_grads=experts)
        vector = torch.stack([sq.float().reshape(())] + [torch.as_tensor(x, dtype=torch.float32, device=device)
                                                        .reshape(()) for x in shares])
        work = comm.all_reduce(vector, group=self.ctx.step_group, async_op=True) \
            if self.ctx.step_group is not None else None
        return vector, work

    def _judge(self, vector: torch.Tensor, scale: float) -> tuple:
        """(norm, shares, why the speculative update would be wrong or "") from the summed vector."""
        values = vector.tolist()
        norm, shares = math.sqrt(values[0]) / scale, values[1:]  # inf and nan stay what they are
        why = "non-finite loss" if not math.isfinite(shares[0]) else "non-finite gradients" \
            if not math.isfinite(norm) else f"gradient norm {norm:.4g} over --clip-grad {self.optimizer.clip_grad:g}" \
            if clip_coefficient(norm, self.optimizer.clip_grad) != 1.0 else ""
        return norm, shares, why

    def drop(self) -> None:
        """Forget the pending step (the state is about to be replaced, e.g. by a checkpoint), after its
        all-reduce, which every rank joined, has completed."""
        p, self.pending = self.pending, None
        if p is not None and p.work is not None:
            p.work.wait()

    def _restore(self, p: _Pending) -> None:
        opt = self.optimizer
        with torch.no_grad():
            for live, copy in zip(opt.rollback_tensors(), p.saved):
                live.copy_(copy)
        opt.steps = p.steps
        if opt.adam is not None:
            adamw.set_step(opt.adam, p.steps)
        opt.publish()

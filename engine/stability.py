"""Loss-spike guard and fault injection: what the trainer does when a step goes bad.

Each iteration the trainer asks `SpikeGuard.check(iteration, loss, grad_norm)` and acts on the answer:
- "ok": step as usual.
- "skip": the loss or gradient norm is NaN/inf; do not apply the update (zero the gradients).
- "spike": the loss is above mean + k·std of the last `window` accepted losses; the step is applied
  (clipping bounds it) but the loss is kept out of the window so one outlier does not widen the band.
- "rollback": the `rollback_after`-th spike within `window` iterations; reload the newest checkpoint,
  then call `guard.rolled_back(loaded_iteration)` (after restoring the guard's saved state, if the
  trainer restores it), and keep scaling the LR by `guard.lr_multiplier(iteration)`.
`guard.events(decision, iteration)` says what to report about it (metrics events and console lines);
the guard also keeps the counts the metrics show (skipped steps, spikes, rollbacks).

Fault drills (`--inject-fault KIND@ITER`) are a `FaultDrill`: the trainer hands each step's
microbatches and loss scaling through `drill.arm(iteration, ...)`, which corrupts them when a drill is
due ("nan": the loss becomes NaN, so the gradients do too; "spike": the batch becomes noise), and
reports the step's loss through `drill.reported_loss`. Each drill fires once, so a rolled-back replay
of its iteration runs clean.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.validation import check_spike_window, parse_faults

OK, SKIP, SPIKE, ROLLBACK = "ok", "skip", "spike", "rollback"
MIN_HISTORY = 10  # accepted losses needed before a mean and std mean anything
# Floor on the std, relative to the mean: a nearly flat window would otherwise call noise a spike.
REL_STD_FLOOR = 1e-3
SPIKE_SEED = 0x5EED  # the fixed seed of corrupt_batch's noise, so a drill is reproducible


@dataclass(frozen=True)
class Decision:
    """`kind` is one of ok, skip, spike, rollback; `info` goes into the metrics event record."""
    kind: str
    info: dict = field(default_factory=dict)


class SpikeGuard:
    def __init__(self, window: int = 50, threshold_k: float = 6.0, rollback_after: int = 0,
                 lr_factor: float = 0.5, lr_steps: int = 100):
        check_spike_window(window)
        self.window, self.k, self.rollback_after = window, threshold_k, rollback_after
        self.lr_factor, self.lr_steps = lr_factor, lr_steps
        self.losses: deque = deque(maxlen=window)
        self.spike_iterations: list[int] = []
        self.skipped = 0
        self.spikes = 0
        self.rollbacks = 0
        self.lr_low_from: Optional[int] = None  # first iteration run with the lowered LR

    @property
    def data_headroom(self) -> int:
        """How many runs' worth of training samples to build: a rollback skips the data it was on instead of
        replaying it, so rolling back needs room for one run's worth of skips."""
        return 2 if self.rollback_after else 1

    @classmethod
    def from_config(cls, stability) -> "SpikeGuard":
        """From engine.config.StabilityConfig."""
        return cls(stability.spike_window, stability.spike_threshold, stability.spike_rollback_after,
                   stability.spike_lr_factor, stability.spike_lr_steps)

    def threshold(self) -> Optional[float]:
        """The loss above which the next step is a spike, or None while the history is too short."""
        if len(self.losses) < min(MIN_HISTORY, self.window):
            return None
        mean = statistics.fmean(self.losses)
        std = max(statistics.pstdev(self.losses, mean), REL_STD_FLOOR * abs(mean))
        return mean + self.k * std

    def check(self, iteration: int, loss: float, grad_norm: Optional[float] = None) -> Decision:
        loss = float(loss)
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(float(grad_norm))):
            self.skipped += 1
            reason = "non-finite loss" if not math.isfinite(loss) else "non-finite gradient norm"
            return Decision(SKIP, {"reason": reason, "loss": _finite_or_str(loss),
                                   "grad_norm": _finite_or_str(grad_norm), "skipped": self.skipped})
        limit = self.threshold()
        if limit is None or loss <= limit:
            self.losses.append(loss)
            return Decision(OK)
        self.spikes += 1
        self.spike_iterations = [i for i in self.spike_iterations if i > iteration - self.window] + [iteration]
        info = {"loss": loss, "threshold": limit, "spikes_in_window": len(self.spike_iterations)}
        if self.rollback_after and len(self.spike_iterations) >= self.rollback_after:
            self.rollbacks += 1
            self.spike_iterations = []
            self.lr_low_from = iteration + 1  # moved by rolled_back() when a checkpoint is reloaded
            return Decision(ROLLBACK, info)
        return Decision(SPIKE, info)

    def events(self, decision: Decision, iteration: int) -> list:
        """What to report about iteration `iteration`: (metrics event kind, its fields, console line) each."""
        out, info = [], decision.info
        if decision.kind == SKIP:
            out.append(("skip", info, f"iteration {iteration}: step skipped ({info['reason']}); "
                                      f"{info['skipped']} skipped so far"))
        elif decision.kind in (SPIKE, ROLLBACK):
            out.append(("spike", info, f"iteration {iteration}: loss spike {info['loss']:.4f} above "
                                       f"{info['threshold']:.4f} ({info['spikes_in_window']} in the window)"))
        if self.lr_multiplier(iteration) == 1.0 and self.lr_multiplier(iteration - 1) != 1.0:
            out.append(("lr_restored", {}, f"iteration {iteration}: the lowered LR period after the rollback is over"))
        return out

    def rollback_events(self, spike_iteration: int, resumed: Optional[int], skipped_to: int) -> list:
        """What to report about the rollback after `spike_iteration`: to the checkpoint of iteration
        `resumed` (None: there was none to go back to), the data skipped to sample `skipped_to`."""
        if resumed is None:
            return [("rollback_impossible", {"reason": "no checkpoint to roll back to"},
                     f"iteration {spike_iteration}: rollback requested but no checkpoint exists; continuing")]
        until = resumed + self.lr_steps
        info = {"resumed_iteration": resumed, "skipped_to_samples": skipped_to, "lr_factor": self.lr_factor,
                "lr_factor_until_iteration": until, "rollbacks": self.rollbacks}
        line = (f"iteration {spike_iteration}: rolled back to the checkpoint of iteration {resumed}; data skipped to "
                f"sample {skipped_to}; LR x{self.lr_factor} through iteration {until}")
        return [("rollback", info, line)]

    def rolled_back(self, loaded_iteration: int) -> None:
        """The trainer reloaded the checkpoint of `loaded_iteration`: lower the LR from the step after it."""
        self.lr_low_from = loaded_iteration + 1

    def lr_multiplier(self, iteration: int) -> float:
        if self.lr_low_from is not None and self.lr_low_from <= iteration < self.lr_low_from + self.lr_steps:
            return self.lr_factor
        return 1.0

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "spike_iterations": list(self.spike_iterations),
                "skipped": self.skipped, "spikes": self.spikes, "rollbacks": self.rollbacks,
                "lr_low_from": self.lr_low_from}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.window)
        self.spike_iterations = list(state["spike_iterations"])
        self.skipped, self.spikes, self.rollbacks = state["skipped"], state["spikes"], state["rollbacks"]
        self.lr_low_from = state["lr_low_from"]


def _finite_or_str(x):
    """JSON has no NaN or inf; keep them readable in event records."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


def poison_loss(loss: torch.Tensor) -> torch.Tensor:
    """The "nan" drill: the loss (and through backward every gradient) becomes NaN."""
    return loss * float("nan")


def corrupt_batch(batch: dict, vocab_size: int, seed: int = SPIKE_SEED) -> dict:
    """The "spike" drill: tokens and labels replaced by uniform noise from a fixed seed.

    A model that has learned anything (loss well below ln V) predicts noise badly, so the loss jumps to
    at least about ln(vocab_size). A fresh model is already near ln V: inject spikes after warm-up.
    The loss mask is kept. Same seed, same noise, on every rank and every run.
    """
    gen = torch.Generator().manual_seed(seed)
    out = dict(batch)
    for key in ("tokens", "labels"):
        t = batch[key]
        out[key] = torch.randint(0, vocab_size, tuple(t.shape), generator=gen, dtype=t.dtype).to(t.device)
    return out


class FaultDrill:
    """--inject-fault drills: {iteration: "nan" | "spike"}, each fired once."""

    def __init__(self, faults: dict, vocab_size: int):
        self.faults, self.vocab_size = dict(faults), vocab_size
        self.active: Optional[str] = None

    @classmethod
    def from_config(cls, stability, vocab_size: int) -> "FaultDrill":
        return cls(parse_faults(stability.inject_fault), vocab_size)

    def arm(self, iteration: int, microbatches: list, scale_loss):
        """(microbatches, scale_loss) for step `iteration`, corrupted when a drill is due there."""
        self.active = self.faults.pop(iteration, None)
        if self.active == "spike":
            return [corrupt_batch(mb, self.vocab_size) for mb in microbatches], scale_loss
        if self.active == "nan":
            return microbatches, lambda loss: poison_loss(scale_loss(loss))
        return microbatches, scale_loss

    def reported_loss(self, loss: float) -> float:
        """The loss step reports: NaN under the "nan" drill (its backward already was)."""
        return float("nan") if self.active == "nan" else loss

"""Learning-rate schedules and batch-size ramp-up, with Megatron-LM's semantics.

LR: linear warm-up from 0 to --lr over --lr-warmup-iters, then one of
  constant: --lr
  linear:   min + (lr - min) * (1 - r)
  cosine:   min + (lr - min) * (1 + cos(pi r)) / 2
  wsd:      --lr until the last --lr-wsd-decay-iters of the decay, then
            min + (lr - min) * (2 * 0.5**q - 1) (Megatron's default "exponential" WSD anneal)
with r = (it - warmup) / (decay_iters - warmup), q the fraction of the WSD anneal done, and --min-lr
after decay_iters (default --train-iters).

Ramp-up (`--rampup-batch-size START INCR SAMPLES`): the global batch starts at START and grows by INCR
each SAMPLES / num_increments consumed samples until it reaches --global-batch-size, where
num_increments = (global - START) / INCR. Megatron counts the LR schedule in samples while ramping up
(warm-up and decay lengths are iterations times the final global batch), so the schedule position of
an iteration is `consumed_samples / global_batch_size`; `schedule_position` gives it, and equals the
iteration number when there is no ramp-up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


def lr_at(iteration: float, opt, train_iters: int) -> float:
    """LR for the step taken after `iteration` completed steps (or that schedule position).

    `opt` is an OptimizerConfig. Like Megatron, step 0 of a warm-up runs at LR 0.
    """
    peak, floor = opt.lr, opt.min_lr
    warmup = opt.lr_warmup_iters
    decay_iters = opt.lr_decay_iters or train_iters
    if warmup > 0 and iteration <= warmup:
        return peak * iteration / warmup
    if opt.lr_decay_style == "constant":
        return peak
    if iteration > decay_iters or decay_iters <= warmup:
        return floor
    ratio = (iteration - warmup) / (decay_iters - warmup)
    if opt.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif opt.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif opt.lr_decay_style == "wsd":
        anneal = opt.lr_wsd_decay_iters
        anneal_start = decay_iters - anneal
        coeff = 1.0 if iteration <= anneal_start else 2.0 * 0.5 ** ((iteration - anneal_start) / anneal) - 1.0
    else:
        raise ValueError(f"unknown --lr-decay-style {opt.lr_decay_style!r}")
    return floor + coeff * (peak - floor)


def schedule_position(consumed_samples: int, global_batch_size: int) -> float:
    """The iteration-equivalent to feed `lr_at`: samples consumed over the final global batch."""
    return consumed_samples / global_batch_size


@dataclass(frozen=True)
class RampupBatchSize:
    """Megatron's ramp-up: START, grown by INCR every SAMPLES/num_increments samples up to `target`."""
    start: int
    increment: int
    samples: int
    target: int

    @classmethod
    def from_config(cls, training, dp: int) -> Optional["RampupBatchSize"]:
        """None without --rampup-batch-size. `training` is a TrainingConfig."""
        if not training.rampup_batch_size:
            return None
        start, incr, samples = training.rampup_batch_size
        return cls(start, incr, samples, training.global_batch_size or training.micro_batch_size * dp)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        increments = (self.target - self.start) // self.increment if self.increment else 0
        if increments <= 0 or self.samples <= 0 or consumed_samples > self.samples:
            return self.target
        steps = int(consumed_samples / (self.samples / increments))
        return min(self.start + steps * self.increment, self.target)


def global_batch_size_at(consumed_samples: int, global_batch_size: int,
                         rampup: Optional[RampupBatchSize] = None) -> int:
    return rampup.global_batch_size_at(consumed_samples) if rampup else global_batch_size


def num_microbatches_at(consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp: int,
                        rampup: Optional[RampupBatchSize] = None) -> int:
    """Gradient-accumulation steps per rank for the iteration that starts at `consumed_samples`."""
    batch = global_batch_size_at(consumed_samples, global_batch_size, rampup)
    per_step = micro_batch_size * dp
    if batch % per_step:
        raise ValueError(f"global batch {batch} at {consumed_samples} consumed samples is not a multiple of "
                         f"micro-batch x dp = {per_step}; fix --rampup-batch-size")
    return batch // per_step

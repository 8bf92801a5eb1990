"""Learning-rate schedules with Megatron-LM's semantics, value for value.

LR: linear warm-up from --lr-warmup-init (default 0) to --lr, then one of
  constant:            --lr
  linear:              min + (lr - min) * (1 - r)
  cosine:              min + (lr - min) * (1 + cos(pi r)) / 2
  inverse-square-root: max(min, lr * sqrt(max(warmup, 1)) / sqrt(max(step, 1)))
  wsd:                 --lr until the last --lr-wsd-decay-iters/-samples of the decay, then
                       min + (lr - min) * c(q) with c(q) by --lr-wsd-decay-style: exponential 2 * 0.5**q - 1
                       (the default), linear 1 - q, cosine (1 + cos(pi q)) / 2, minus_sqrt 1 - sqrt(q)
with r = (step - warmup) / (decay - warmup), q the fraction of the WSD anneal done, and --min-lr after the
decay length (default: the whole run). `WSD` is Megatron-LM's spelling of wsd.

Megatron-LM counts the schedule in samples: an iteration-based run's lengths are iterations x the global
batch size, a --train-samples run gives them in samples (--lr-decay-samples, default --train-samples;
--lr-warmup-samples; --lr-wsd-decay-samples), and --lr-warmup-fraction makes the warm-up that fraction of
the decay length. `lr_at_sample` computes exactly so, operation for operation (`_lengths`, `_lr` follow
Megatron's get_optimizer_param_scheduler and OptimizerParamScheduler.get_lr), so the trainer's LR equals
Megatron's bit for bit; `lr_at` is the same schedule in iterations (fractional positions allowed).

The trainer's position is the samples consumed under batch-size ramp-up, else iteration x global batch
(engine.data.rampup.BatchSizeSchedule.lr_samples; the same in a run without spike rollbacks).
"""
from __future__ import annotations

import math
from typing import Optional


# The OptimizerConfig fields that shape the LR curve, all but lr_decay_iters, whose default is --train-iters and
# which is read through `decay_iters`. A resumed run is checked on both (engine.resolve.check_resumed).
SCHEDULE_FIELDS = ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "lr_decay_style", "lr_warmup_iters",
                   "lr_wsd_decay_iters", "lr_wsd_decay_style", "lr_warmup_fraction", "lr_warmup_init",
                   "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples")


class StepLR(float):
    """The learning rates of one step: the main schedule's (this float: what is logged, what every parameter but
    the vocabulary tables takes) and `decoupled`, the word embedding's and output layer's (Megatron-LM's
    --decoupled-lr: the same warm-up and decay between --decoupled-lr and --decoupled-min-lr, default --min-lr;
    the main rate without it)."""

    decoupled: float

    def __new__(cls, lr: float, decoupled: Optional[float] = None):
        rates = super().__new__(cls, lr)
        rates.decoupled = float(lr if decoupled is None else decoupled)
        return rates

    def __reduce__(self):
        return StepLR, (float(self), self.decoupled)


def decay_iters(lr_decay_iters: Optional[int], train_iters: Optional[int]) -> Optional[int]:
    """The iterations the LR decays over: --lr-decay-iters, default --train-iters."""
    return lr_decay_iters or train_iters


def lr_at(iteration: float, opt, train_iters: int) -> float:
    """LR for the step taken after `iteration` completed steps (or that schedule position, in iterations).

    `opt` is an OptimizerConfig; the run is iteration-based (its *_samples settings are not read). Like
    Megatron, step 0 of a warm-up runs at --lr-warmup-init (default 0).
    """
    return _lr(iteration, opt, *_lengths(opt, train_iters, None, 1))


def lr_at_sample(samples: int, opt, training) -> float:
    """LR for the step taken after `samples` samples, in Megatron-LM's unit: the samples of a --train-samples
    run, else iterations x --global-batch-size. `training` is a resolved TrainingConfig."""
    return _lr(samples, opt, *_lengths(opt, training.train_iters, training.train_samples, training.global_batch_size))


def rates_at_sample(samples: int, opt, training, factor: float = 1.0) -> StepLR:
    """`lr_at_sample` with the decoupled rate beside it (StepLR), both times `factor`."""
    lengths = _lengths(opt, training.train_iters, training.train_samples, training.global_batch_size)
    main = _lr(samples, opt, *lengths)
    if opt.decoupled_lr is None:
        return StepLR(main * factor)
    own = _lr(samples, opt, *lengths, peak=opt.decoupled_lr, floor=opt.decoupled_floor())
    return StepLR(main * factor, own * factor)


def _lengths(opt, train_iters: int, train_samples, per_iteration: int) -> tuple:
    """(warm-up, decay, WSD anneal) lengths in the schedule's unit, as Megatron-LM's get_optimizer_param_scheduler
    derives them; the anneal is None when not set."""
    if train_samples is None:
        decay = decay_iters(opt.lr_decay_iters, train_iters) * per_iteration
        wsd = None if opt.lr_wsd_decay_iters is None else opt.lr_wsd_decay_iters * per_iteration
        warmup = opt.lr_warmup_iters * per_iteration
    else:
        decay = opt.lr_decay_samples or train_samples
        wsd, warmup = opt.lr_wsd_decay_samples, opt.lr_warmup_samples
    if opt.lr_warmup_fraction is not None:
        warmup = opt.lr_warmup_fraction * decay
    return warmup, decay, wsd


def _lr(step, opt, warmup, decay, wsd, peak=None, floor=None) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr at `step`, in the same operations and order; `peak` and
    `floor`: a param group's own max_lr and min_lr (default --lr and --min-lr)."""
    peak = opt.lr if peak is None else peak
    floor = opt.min_lr if floor is None else floor
    init = opt.lr_warmup_init
    if warmup > 0 and step <= warmup:
        return init + (peak - init) * float(step) / float(warmup)
    style = opt.lr_decay_style.lower()
    if style == "constant":
        return peak
    if step > decay or decay <= warmup:
        return floor
    if style == "inverse-square-root":
        return max(floor, peak * max(warmup, 1) ** 0.5 / (max(step, 1) ** 0.5))
    ratio = float(step - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif style == "wsd":
        coeff = _wsd_coeff(step, decay - wsd, wsd, opt.lr_wsd_decay_style)
    else:
        raise ValueError(f"unknown --lr-decay-style {opt.lr_decay_style!r}")
    return floor + coeff * (peak - floor)


def _wsd_coeff(step, anneal_start, anneal, style: str) -> float:
    """1 until the anneal starts, then the --lr-wsd-decay-style shape from 1 down to 0."""
    if step <= anneal_start:
        return 1.0
    q = float(step - anneal_start) / float(anneal)
    if style == "linear":
        return 1.0 - q
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * q) + 1.0)
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(q)
    if style == "exponential":
        return (2.0 * math.pow(0.5, q)) - 1.0
    raise ValueError(f"unknown --lr-wsd-decay-style {style!r}")

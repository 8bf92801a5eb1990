"""Learning-rate schedules with Megatron-LM's semantics.

LR: linear warm-up from 0 to --lr over --lr-warmup-iters, then one of
  constant: --lr
  linear:   min + (lr - min) * (1 - r)
  cosine:   min + (lr - min) * (1 + cos(pi r)) / 2
  wsd:      --lr until the last --lr-wsd-decay-iters of the decay, then
            min + (lr - min) * (2 * 0.5**q - 1) (Megatron's default "exponential" WSD anneal)
with r = (it - warmup) / (decay_iters - warmup), q the fraction of the WSD anneal done, and --min-lr
after decay_iters (default --train-iters).

The position fed to `lr_at` is the iteration count, or under batch-size ramp-up the samples consumed
over the final batch size (engine.data.rampup.BatchSizeSchedule.lr_position).
"""
from __future__ import annotations

import math


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


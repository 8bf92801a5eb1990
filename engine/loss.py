"""How a step's loss is normalised, in one place: a token mean per microbatch, then a mean over microbatches.

The last stage's model gives one loss per token of this rank's positions ([b, s/cp], the z-loss included;
engine/model.py). A microbatch's loss is the sum of those over its unmasked tokens divided by the unmasked
tokens of the whole microbatch (`token_count`, counted before the sequence is cut for context parallelism),
so the CP ranks' shares add up to the microbatch's mean (`microbatch_loss`). Each microbatch's backward is
scaled by 1 / microbatches (engine.pipeline.runner), so a step's gradient is that of the mean over
microbatches; the data-parallel replicas' gradients are then averaged and the CP ranks' summed
(`replica_divisor`, applied by engine.optim.grad_buffer), as are the losses they report (`step_loss`). This is Megatron-LM's rule without --calculate-per-token-loss: every
microbatch weighs the same whatever its count of unmasked tokens.
"""
from __future__ import annotations

from typing import Optional

import torch


def token_count(batch: dict) -> torch.Tensor:
    """What a microbatch's loss is divided by: its unmasked tokens (at least one), over whole sequences."""
    mask = batch.get("loss_mask")
    if mask is None:
        return torch.tensor(float(batch["labels"].numel()), device=batch["labels"].device)
    return mask.float().sum().clamp(min=1.0)


def microbatch_loss(per_token: torch.Tensor, loss_mask: Optional[torch.Tensor], count: torch.Tensor) -> torch.Tensor:
    """This rank's share of a microbatch's loss: its tokens' losses (unmasked ones only) summed, over `count`."""
    if loss_mask is not None:
        per_token = per_token * loss_mask.float()
    return per_token.sum() / count


def mean_loss(per_token: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A whole microbatch's loss on one rank (no context parallelism): the token mean of `microbatch_loss`."""
    labels = {"labels": per_token} if loss_mask is None else {"labels": per_token, "loss_mask": loss_mask}
    return microbatch_loss(per_token, loss_mask, token_count(labels))


def replica_divisor(ctx) -> int:
    """What the sum of a gradient over its replicas is divided by: dp. The CP ranks' parts add up (each rank's
    loss is its positions' share of the mean), and so do the parts of an expert's gradient its EP group sent."""
    return ctx.dp_size


def step_loss(losses: list, dp: int, device) -> torch.Tensor:
    """This rank's share of the step's loss from its microbatches' shares: their mean over the dp replicas
    (summed over the ranks holding parts of a sequence, it is the step's loss)."""
    if not losses:
        return torch.zeros((), device=device)
    return torch.stack(losses).float().mean() / dp

"""Activation recomputation that replays dropout exactly.

Forward runs `fn` without keeping its activations; backward runs it again from the saved inputs and
back-propagates through the replay; an input may be None (an optional argument such as rotary angles).
The default generator and every tracked stream are captured at the first run and restored for the
replay (then put back), so recomputed dropout masks match.
"""
from __future__ import annotations

import torch

from engine.parallel import random as rng


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tracker, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.snapshot = rng.capture(tracker)
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [a if a is None else a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        stash = rng.capture(ctx.tracker)
        rng.restore(ctx.tracker, ctx.snapshot)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            rng.restore(ctx.tracker, stash)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[i.grad if i is not None and i.requires_grad else None for i in inputs])


def recompute(fn, tracker, *tensors):
    """fn(*tensors) whose activations are rebuilt in backward instead of stored."""
    return _Recompute.apply(fn, tracker, *tensors)

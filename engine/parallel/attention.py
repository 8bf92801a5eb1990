"""A layer's attention as one callable: `attend(q, k, v, mask, dropout_p)`, whatever the parallel layout.

q, k, v are [b, s, heads, d] of this rank's positions; the result is [b, s, query heads, d]; `mask` is the
layer's, joined with the microbatch's packed documents when it has them (AttentionMask.within). With one
context-parallel rank the kernels of kernels.dispatch run on the positions at hand; with several, the
other ranks' keys and values come round the ring or by all-gather (engine.parallel.ring_attention). The
choice is made here once, from the context, so the model's attention has no branch on the layout.
"""
from __future__ import annotations

from engine.attention_mask import AttentionMask
from engine.parallel.ring_attention import ContextAttention
from kernels import dispatch


class LocalAttention:
    """Attention over the positions this rank holds, by a resolved kernels.dispatch backend."""

    def __init__(self, backend: str):
        self.kernel = dispatch.attention_fn(backend)

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0):
        return self.kernel(q, k, v, mask.causal, dropout_p, None, mask.window, mask.bounds)


def attention_for(ctx, backend: str, device):
    """The attention entry point of a layer on `device` with resolved `backend`: local, or round the CP group."""
    if ctx.cp_size > 1:
        return ContextAttention(ctx, dispatch.attention_block_backend(backend, device))
    return LocalAttention(backend)

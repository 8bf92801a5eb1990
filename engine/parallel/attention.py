"""A layer's attention as one callable: `attend(q, k, v, mask, dropout_p, softmax_scale)`, whatever the layout.

q, k, v are [b, s, heads, d] of this rank's positions; the result is [b, s, query heads, d of v]; `mask` is the
layer's, joined with the microbatch's packed documents when it has them (AttentionMask.within). With one
context-parallel rank the kernels of kernels.dispatch run on the positions at hand; with several, the
other ranks' keys and values come round the ring or by all-gather (engine.parallel.ring_attention). The
choice is made here once, from the context, so the model's attention has no branch on the layout.

Values may have fewer channels than queries and keys (multi-head latent attention: 128 against 192 in
DeepSeek-V3). Every kernel here takes one head dimension, so such values are zero-padded to the q/k width on the
way in and the output cut back on the way out: exact (a zero channel of v gives a zero channel of the output,
and its gradient is never read), at the price of the padded channels' work and, under context parallelism,
their bytes on the ring. `softmax_scale`: None is 1/sqrt(q/k channels).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.attention_mask import AttentionMask
from engine.parallel.recompute import recompute
from engine.parallel.ring_attention import ContextAttention
from kernels import dispatch


class LocalAttention:
    """Attention over the positions this rank holds, by a resolved kernels.dispatch backend."""

    def __init__(self, backend: str):
        self.kernel = dispatch.attention_fn(backend)

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0, softmax_scale=None):
        return self.kernel(q, k, v, mask.causal, dropout_p, softmax_scale, mask.window, mask.bounds)


class _NarrowValues:
    """An attention whose values may be narrower than q and k: padded with zeros in, cut back out."""

    def __init__(self, attend):
        self.attend = attend

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float = 0.0, softmax_scale=None):
        dv, d = v.shape[-1], q.shape[-1]
        if dv == d:
            return self.attend(q, k, v, mask, dropout_p, softmax_scale)
        out = self.attend(q, k, F.pad(v, (0, d - dv)), mask, dropout_p, softmax_scale)
        return out[..., :dv]


def attention_for(ctx, backend: str, device):
    """The attention entry point of a layer on `device` with resolved `backend`: local, or round the CP group."""
    if ctx.cp_size > 1:
        return _NarrowValues(ContextAttention(ctx, dispatch.attention_block_backend(backend, device)))
    return _NarrowValues(LocalAttention(backend))


class AttentionCore:
    """What a decoder layer's attention module does between its projections: the layer's mask joined with the
    microbatch's documents, dropout from the tensor-parallel stream, selective recomputation, and the entry point
    resolved once for the device and dtype the layer is built on (a model on the meta device never runs)."""

    def __init__(self, cfg, ctx, layer: int, device, dtype):
        self.ctx, self.dropout = ctx, cfg.attention_dropout
        self.selective = cfg.recompute_granularity == "selective"
        self.mask = AttentionMask.of(cfg, layer)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.attend = None
        if device.type != "meta":
            backend = dispatch.resolve_attention_backend(cfg.attention_backend, device, cfg.attention_dropout,
                                                         dtype or torch.get_default_dtype())
            self.attend = attention_for(ctx, backend, device)

    def _run(self, q, k, v, mask: AttentionMask, dropout_p: float, softmax_scale):
        if dropout_p == 0.0:  # draws no random numbers: no stream to switch to (reading one breaks a compiled graph)
            return self.attend(q, k, v, mask, dropout_p, softmax_scale)
        with self.ctx.dropout_rng(split_over_tp=True):  # heads are split over TP
            return self.attend(q, k, v, mask, dropout_p, softmax_scale)

    def __call__(self, q, k, v, documents, training: bool, softmax_scale=None):
        """q, k, v [s, b, heads, d] -> [s, b, heads * d of v]. Attention keeps q, k and v for backward: each gets
        storage of its own (a copy where it is a view), so that no view keeps a fused projection's output alive."""
        s, b = q.shape[:2]
        q, k, v = (t.contiguous().transpose(0, 1) for t in (q, k, v))
        core = functools.partial(self._run, mask=self.mask.within(documents),
                                 dropout_p=self.dropout if training else 0.0, softmax_scale=softmax_scale)
        out = recompute(core, self.ctx.rng, q, k, v) if self.selective and training else core(q, k, v)
        return out.transpose(0, 1).reshape(s, b, -1)

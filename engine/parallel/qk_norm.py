"""QK-norm (--qk-layernorm): queries and keys normalised after the QKV projection and before RoPE, which keeps
attention logits bounded at high learning rates; and what tensor parallelism asks of each of its two forms.

Per head (`--qk-layernorm-scope head`: Qwen3, and Megatron-LM's --qk-layernorm): each head's head_dim channels
are normalised, with the model's --normalization, by one weight [head_dim] that all query heads share (and one
that all key heads share). A TP rank holds whole heads, so the norm is local; the weight is replicated and each
rank's gradient covers only its own heads, so the gradient code sums it over TP (`tp_partial_grad`, as
Megatron-LM's finalize_model_grads does for its q/k_layernorm).

Over the whole projection (`projection`: OLMo-2): RMSNorm over all of a token's query channels, heads x head_dim
(and over all its key channels, groups x head_dim), each channel with its own weight. A TP rank holds its
query groups, a contiguous slice of each projection, so the weights are split over TP like the projection's
rows (`tp_axis` 0: checkpoints reshard them), and a token's sum of squares is all-reduced over TP. Backward
needs one more sum over the whole projection (of the output gradient times the input), all-reduced the same
way; q's and k's sums travel together, one all-reduce of [s, b, 2] fp32 each way per layer.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.parallel import comm
from engine.parallel.layers import Norm, make_param
from kernels.reference import cast_to


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        comm.all_reduce(t, group)
    return t


class _ProjectionRMSNorm(torch.autograd.Function):
    """RMSNorm of q [s, b, n, d] and of k [s, b, g, d] over their whole projections, of which these are this TP
    rank's slices, with weights [n*d] and [g*d]; keeps only q, k and 1/rms for backward (not the normalised
    copies, nor a view of the fused QKV output)."""

    @staticmethod
    def forward(ctx, q, k, wq, wk, eps, sizes, group):
        xs = (q.float(), k.float())
        squares = _summed(torch.stack([x.pow(2).sum((-2, -1)) for x in xs], -1), group)  # [s, b, 2]
        rstd = torch.rsqrt(squares / squares.new_tensor(sizes) + eps)
        ctx.save_for_backward(q, k, wq, wk, rstd)
        ctx.sizes, ctx.group = sizes, group
        return tuple(cast_to(x * rstd[..., i, None, None] * w.float().view(x.shape[-2:]), t.dtype)
                     for i, (x, w, t) in enumerate(zip(xs, (wq, wk), (q, k))))

    @staticmethod
    def backward(ctx, dq, dk):
        q, k, wq, wk, rstd = ctx.saved_tensors
        xs, dys, ws = (q.float(), k.float()), (dq.float(), dk.float()), (wq, wk)
        gs = [dy * w.float().view(x.shape[-2:]) for x, dy, w in zip(xs, dys, ws)]
        dots = _summed(torch.stack([(g * x).sum((-2, -1)) for g, x in zip(gs, xs)], -1), ctx.group)
        dxs, dws = [], []
        for i, (x, dy, g, w, t) in enumerate(zip(xs, dys, gs, ws, (q, k))):
            r = rstd[..., i, None, None]  # y = x r w with r = (sum(x^2) / N + eps)^-1/2, the sum over all of x
            dxs.append((r * (g - x * r.pow(2) * (dots[..., i, None, None] / ctx.sizes[i]))).to(t.dtype))
            dws.append((dy * x * r).reshape(-1, w.numel()).sum(0).to(w.dtype))
        return (*dxs, *dws, None, None, None)


class _Weight(nn.Module):
    """A projection's norm weight alone, split over TP like the projection's rows (the statistics are
    computed for q and k together)."""

    def __init__(self, size, ctx, device, dtype):
        super().__init__()
        self.weight = make_param((size,), 0, ctx, ("ones",), device, dtype)


class QKNorm(nn.Module):
    """The norms of q and k (`q`, `k`): per head, or over the whole projection (see the module docstring)."""

    def __init__(self, cfg, ctx, device=None, dtype=None):
        super().__init__()
        d, self.eps = cfg.head_dim(), cfg.norm_epsilon
        self.per_head = cfg.qk_layernorm_scope == "head"
        self.group = ctx.tp_group if ctx.tp_size > 1 else None
        if self.per_head:
            self.q, self.k = (Norm(d, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype, per_head=True)
                              for _ in range(2))
        else:
            self.sizes = (cfg.num_attention_heads * d, cfg.resolved_query_groups() * d)
            self.q, self.k = (_Weight(size, ctx, device, dtype) for size in self.sizes)

    def forward(self, q, k):
        """q [s, b, heads/tp, d], k [s, b, groups/tp, d] -> both normalised, each in storage of its own."""
        k = k.contiguous()  # a view of the fused QKV output: the norm keeps its input, not the whole output
        if self.per_head:
            return self.q(q), self.k(k)
        return _ProjectionRMSNorm.apply(q, k, self.q.weight, self.k.weight, self.eps, self.sizes, self.group)

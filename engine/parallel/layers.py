"""Tensor-parallel layers: vocab-parallel embedding, column- and row-parallel linears, norms.

Every parameter describes itself, which is what keeps weights and checkpoints layout-independent:
- `tp_axis`: the axis of the full tensor split over the TP group (None: replicated);
- `full_shape`: the unsplit shape;
- `init`: ("normal", std) | ("ones",) | ("zeros",), and `init_key` naming the stream it is drawn from.
`init_weights` draws each full tensor from a generator seeded by (seed, init_key) and keeps this
rank's slice, so tp 1 and tp 4 start from the same full tensors.
Replicated parameters whose gradient is partial under sequence parallelism carry
`sequence_parallel_grad = True`; the gradient code sums them over TP.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import mappings
from kernels import dispatch


def make_param(full_shape, tp_axis, ctx, init, device=None, dtype=None, init_key=None, sp_grad=False) -> nn.Parameter:
    shape = list(full_shape)
    if tp_axis is not None:
        assert shape[tp_axis] % ctx.tp_size == 0, (full_shape, tp_axis, ctx.tp_size)
        shape[tp_axis] //= ctx.tp_size
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    p.tp_axis, p.full_shape, p.init, p.init_key = tp_axis, tuple(full_shape), init, init_key
    p.sequence_parallel_grad = sp_grad and ctx.sequence_parallel
    return p


def _stream_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63)


def full_init_tensor(p, name: str, seed: int) -> torch.Tensor:
    """The unsplit initial value of a parameter (fp32, CPU)."""
    kind = p.init[0]
    if kind == "ones":
        return torch.ones(p.full_shape)
    if kind == "zeros":
        return torch.zeros(p.full_shape)
    gen = torch.Generator().manual_seed(_stream_seed(seed, p.init_key or name))
    # Draw only the rows that hold tokens: the padded vocabulary size depends on tp, the draw must not.
    rows = getattr(p, "valid_rows", None) or p.full_shape[0]
    full = torch.zeros(p.full_shape)
    full[:rows] = torch.empty((rows, *p.full_shape[1:])).normal_(0.0, p.init[1], generator=gen)
    return full


def tp_slice(full: torch.Tensor, tp_axis, ctx) -> torch.Tensor:
    if tp_axis is None:
        return full
    return full.chunk(ctx.tp_size, dim=tp_axis)[ctx.tp_rank]


@torch.no_grad()
def init_weights(module: nn.Module, ctx, seed: int) -> None:
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        p.copy_(tp_slice(full_init_tensor(p, name, seed), p.tp_axis, ctx))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the input is gathered (SP) or copied (no SP).

    `stack` > 1 keeps `stack` independent output blocks (SwiGLU's gate and up) as one parameter of
    full shape [stack, out, in] split on axis 1, so every rank holds matching slices of each block.
    """

    def __init__(self, in_features, out_features, ctx, *, bias=True, std=0.02, stack=1, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx
        shape = (stack, out_features, in_features) if stack > 1 else (out_features, in_features)
        axis = 1 if stack > 1 else 0
        self.weight = make_param(shape, axis, ctx, ("normal", std), device, dtype)
        self.bias = make_param(shape[:-1], axis, ctx, ("zeros",), device, dtype) if bias else None

    def forward(self, x):
        group = self.ctx.tp_group
        x = mappings.gather_from_sp(x, group) if self.ctx.sequence_parallel else mappings.copy_to_tp(x, group)
        w = self.weight.reshape(-1, self.weight.shape[-1])
        b = self.bias.reshape(-1) if self.bias is not None else None
        return F.linear(x, w, b)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums reduced (or reduce-scattered under SP)."""

    def __init__(self, in_features, out_features, ctx, *, bias=True, std=0.02, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx
        self.weight = make_param((out_features, in_features), 1, ctx, ("normal", std), device, dtype)
        self.bias = make_param((out_features,), None, ctx, ("zeros",), device, dtype, sp_grad=True) if bias else None

    def forward(self, x):
        group = self.ctx.tp_group
        y = F.linear(x, self.weight)
        y = mappings.reduce_scatter_to_sp(y, group) if self.ctx.sequence_parallel else mappings.reduce_from_tp(y, group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP; each rank looks up its own range and the partial results are summed."""

    def __init__(self, vocab_padded, vocab, hidden, ctx, *, std=0.02, device=None, dtype=None, init_key=None):
        super().__init__()
        self.ctx = ctx
        self.weight = make_param((vocab_padded, hidden), 0, ctx, ("normal", std), device, dtype, init_key=init_key)
        self.weight.valid_rows = vocab
        self.per_rank = vocab_padded // ctx.tp_size
        self.start = ctx.tp_rank * self.per_rank

    def forward(self, tokens):
        """tokens [b, s] -> [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        tokens = tokens.t()
        if self.ctx.tp_size > 1:
            outside = (tokens < self.start) | (tokens >= self.start + self.per_rank)
            local = (tokens - self.start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(tokens, self.weight)
        group = self.ctx.tp_group
        return mappings.reduce_scatter_to_sp(out, group) if self.ctx.sequence_parallel else mappings.reduce_from_tp(out, group)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim; replicated over TP (partial grads under SP)."""

    def __init__(self, hidden, ctx, kind="LayerNorm", eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = make_param((hidden,), None, ctx, ("ones",), device, dtype, sp_grad=True)
        self.bias = make_param((hidden,), None, ctx, ("zeros",), device, dtype, sp_grad=True) if kind == "LayerNorm" else None

    def forward(self, x):
        if self.kind == "RMSNorm":
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.layer_norm(x, self.weight, self.bias, self.eps)

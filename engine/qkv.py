"""The fused QKV projection's output split into queries, keys and values, with a backward that writes its gradient
once.

The projection's output is [s, b, groups x (queries per group + 2) x head dim], each query group's queries, key
and value side by side (engine.model.Attention says why). Split by indexing, autograd's backward of each of the
three pieces allocates a zero tensor of the whole output, copies the piece's gradient into it, and then adds the
three: three fills, three copies and two adds of the whole output per layer and microbatch. On the H200 profile of
2026-11-27 (1.3B Llama, micro batch 2) those were the step's 96 of 108 `aten::fill_` (2.2 ms), 64 of its 130 bf16
`aten::add_` and a share of its 444 `aten::copy_`: about 1.1 GB of memory traffic a layer and microbatch at micro
batch 8, against 0.2 GB for writing the gradient once.

`split_qkv` gives q, k and v as tensors of their own (contiguous: attention keeps them for backward, and a view would
keep the whole output alive) and assembles their gradients with one concatenation. The numbers are the same bit for
bit: each element of the gradient is one piece's element either way (a sum with zeros adds nothing).
"""
from __future__ import annotations

import torch


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, groups: int, per_group: int, head_dim: int):
        s, b = qkv.shape[:2]
        ctx.shape = (s, b, groups, per_group + 2, head_dim)
        whole = qkv.view(ctx.shape)
        q = whole[..., :per_group, :].reshape(s, b, groups * per_group, head_dim)
        return q, whole[..., per_group, :].contiguous(), whole[..., per_group + 1, :].contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        s, b, groups, width, head_dim = ctx.shape
        given = next(g for g in (dq, dk, dv) if g is not None)
        shapes = ((s, b, groups, width - 2, head_dim), (s, b, groups, 1, head_dim), (s, b, groups, 1, head_dim))
        parts = [given.new_zeros(shape) if g is None else g.reshape(shape) for g, shape in zip((dq, dk, dv), shapes)]
        return torch.cat(parts, dim=3).view(s, b, -1), None, None, None


def split_qkv(qkv: torch.Tensor, groups: int, per_group: int, head_dim: int) -> tuple:
    """q [s, b, groups x per_group, head_dim], k and v [s, b, groups, head_dim] from the fused projection's output
    [s, b, groups x (per_group + 2) x head_dim] (this rank's query groups)."""
    return _SplitQKV.apply(qkv, groups, per_group, head_dim)

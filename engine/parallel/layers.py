"""Tensor-parallel layers: vocab-parallel embedding, column- and row-parallel linears, norms.

Every parameter describes itself with a `ParamSpec` (`p.spec`, read through `spec_of`), which is what
keeps weights and checkpoints layout-independent: its full shape and TP axis, how it is initialised,
and the few facts the gradient code, the norm and the checkpoint need. `init_weights` draws each full
tensor from a generator seeded by (seed, init_key) and keeps this rank's slice, so tp 1 and tp 4 start
from the same full tensors. Each layer enters and leaves its tensor-parallel region through
`mappings.enter_tp_linear` / `mappings.exit_tp`, which pick the communication the parallel context
calls for (under sequence parallelism a column-parallel linear keeps only its input's sequence shard).
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import mappings, weight_grad_store
from kernels import dispatch


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter is, whatever the layout. Renaming or reshaping one changes what checkpoints hold."""
    full_shape: tuple
    tp_axis: Optional[int] = None       # the axis split over the TP group; None: replicated
    init: tuple = ("zeros",)            # ("normal", std) | ("ones",) | ("zeros",)
    init_key: Optional[str] = None      # the random stream it is drawn from (default: its own name)
    valid_rows: Optional[int] = None    # vocabulary rows that hold tokens; the rows after them are padding
    tied: bool = False                  # one of a pair kept equal across the first and last pipeline stage
    copy_of: Optional[str] = None       # the last stage's copy of this parameter: stored and counted there once
    sp_partial_grad: bool = False       # replicated, but each TP rank's gradient covers only its sequence slice
                                        # under sequence parallelism: summed over TP by the gradient code
    tp_partial_grad: bool = False       # replicated, but each TP rank's gradient covers only its own heads (the
                                        # per-head QK-norm): summed over TP by the gradient code whenever tp > 1
    ep_axis: Optional[int] = None       # experts: the axis (of global expert ids) split over the EP group;
                                        # reduced over the experts' replicas (edp x cp), not dp x cp
    matrix: Optional[str] = None        # a hidden layer's weight, which Muon orthogonalises as a whole matrix:
                                        # "linear" [out, in] (stacked blocks [k, out, in] as one [k*out, in]) or
                                        # "experts" [E, in, out] (one [out, in] matrix per expert); None: not one
    row_blocks: Optional[tuple] = None  # "linear": rows per repeat that are separate matrices (the fused QKV's
                                        # q, k and v rows of each query group)


def spec_of(p) -> ParamSpec:
    """A parameter's spec (one made elsewhere than `make_param` is replicated and plain)."""
    spec = getattr(p, "spec", None)
    return spec if spec is not None else ParamSpec(tuple(p.shape))


def is_vocabulary_table(p) -> bool:
    """The word embedding or the output layer, whose rows are the padded vocabulary (what Megatron-Core marks
    is_embedding_or_output_parameter; a learned position table is not one)."""
    return spec_of(p).valid_rows is not None


def make_param(full_shape, tp_axis, ctx, init, device=None, dtype=None, **spec) -> nn.Parameter:
    """This rank's slice of a parameter of `full_shape`; `spec`: the other ParamSpec fields."""
    shape = list(full_shape)
    if tp_axis is not None:
        assert shape[tp_axis] % ctx.tp_size == 0, (full_shape, tp_axis, ctx.tp_size)
        shape[tp_axis] //= ctx.tp_size
    if spec.get("ep_axis") is not None:
        assert shape[spec["ep_axis"]] % ctx.ep_size == 0, (full_shape, ctx.ep_size)
        shape[spec["ep_axis"]] //= ctx.ep_size
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    p.spec = ParamSpec(tuple(full_shape), tp_axis, init, **spec)
    return p


def mark_tied(p) -> None:
    p.spec = dataclasses.replace(spec_of(p), tied=True)


def _stream_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63)


def full_init_tensor(p, name: str, seed: int) -> torch.Tensor:
    """The unsplit initial value of a parameter (fp32, CPU)."""
    spec = spec_of(p)
    kind = spec.init[0]
    if kind == "ones":
        return torch.ones(spec.full_shape)
    if kind == "zeros":
        return torch.zeros(spec.full_shape)
    gen = torch.Generator().manual_seed(_stream_seed(seed, spec.init_key or name))
    # Draw only the rows that hold tokens: the padded vocabulary size depends on tp, the draw must not.
    rows = spec.valid_rows or spec.full_shape[0]
    full = torch.zeros(spec.full_shape)
    full[:rows] = torch.empty((rows, *spec.full_shape[1:])).normal_(0.0, spec.init[1], generator=gen)
    return full


def tp_slice(full: torch.Tensor, tp_axis, ctx) -> torch.Tensor:
    if tp_axis is None:
        return full
    return full.chunk(ctx.tp_size, dim=tp_axis)[ctx.tp_rank]


def local_slice(full: torch.Tensor, spec: ParamSpec, ctx) -> torch.Tensor:
    """This rank's part of a full tensor: its TP slice, and its experts under expert parallelism."""
    full = tp_slice(full, spec.tp_axis, ctx)
    if spec.ep_axis is None or ctx.ep_size == 1:
        return full
    return full.chunk(ctx.ep_size, dim=spec.ep_axis)[ctx.ep_rank]


@torch.no_grad()
def init_weights(module: nn.Module, ctx, seed: int) -> None:
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        p.copy_(local_slice(full_init_tensor(p, name, seed), spec_of(p), ctx))


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the input enters the tensor-parallel region first.

    `fp8`: the layer's FP8 GEMMs when a run trains in FP8 (engine.fp8.attach gives it), else None.

    `stack` > 1 keeps `stack` independent output blocks (SwiGLU's gate and up) as one parameter of
    full shape [stack, out, in] split on axis 1, so every rank holds matching slices of each block.
    """
    fp8 = None

    def __init__(self, in_features, out_features, ctx, *, bias=True, std=0.02, stack=1, row_blocks=None, device=None,
                 dtype=None):
        """`row_blocks`: rows of each repeat of the output that are matrices of their own (ParamSpec.row_blocks)."""
        super().__init__()
        self.ctx = ctx
        shape = (stack, out_features, in_features) if stack > 1 else (out_features, in_features)
        axis = 1 if stack > 1 else 0
        self.weight = make_param(shape, axis, ctx, ("normal", std), device, dtype, matrix="linear",
                                 row_blocks=row_blocks)
        self.bias = make_param(shape[:-1], axis, ctx, ("zeros",), device, dtype) if bias else None

    def forward(self, x):
        if self.fp8 is not None:  # FP8 GEMMs (engine.fp8), entering the input itself (FP8 codes gathered under SP)
            return self.fp8.enter(x, self.weight, self.bias)
        return mappings.enter_tp_linear(x, self.weight, self.bias, self.ctx)  # stacked blocks become output rows


class ReplicatedLinear(nn.Module):
    """y = x W^T on the tokens this rank holds, W whole on every tp rank (MLA's latent down-projections, MTP's
    projection): no communication; under sequence parallelism each rank's gradient covers its own tokens."""

    def __init__(self, in_features, out_features, ctx, *, std=0.02, device=None, dtype=None):
        super().__init__()
        self.weight = make_param((out_features, in_features), None, ctx, ("normal", std), device, dtype,
                                 sp_partial_grad=True, matrix="linear")

    def forward(self, x):
        return weight_grad_store.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the partial sums leave the tensor-parallel region
    (`fp8`: as the column-parallel linear's)."""
    fp8 = None

    def __init__(self, in_features, out_features, ctx, *, bias=True, std=0.02, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx
        self.weight = make_param((out_features, in_features), 1, ctx, ("normal", std), device, dtype, matrix="linear")
        self.bias = make_param((out_features,), None, ctx, ("zeros",), device, dtype, sp_partial_grad=True) \
            if bias else None

    def forward(self, x):
        if self.fp8 is not None:  # FP8 GEMMs (engine.fp8), leaving the region itself (FP8 gradient codes under SP)
            y = self.fp8.leave(x, self.weight)
        else:
            y = mappings.exit_tp(weight_grad_store.linear(x, self.weight), self.ctx)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP; each rank looks up its own range and the partial results are summed."""

    def __init__(self, vocab_padded, vocab, hidden, ctx, *, std=0.02, device=None, dtype=None, init_key=None):
        super().__init__()
        self.ctx = ctx
        self.weight = make_param((vocab_padded, hidden), 0, ctx, ("normal", std), device, dtype, init_key=init_key,
                                 valid_rows=vocab)

    def forward(self, tokens):
        """tokens [b, s] -> [s, b, h] ([s/tp, b, h] where the context splits the sequence)."""
        return vocab_parallel_lookup(tokens, self.weight, self.ctx)


def vocab_parallel_lookup(tokens, weight, ctx):
    """Rows of the vocabulary-parallel table `weight` (this rank's V/tp rows) for tokens [b, s]: [s, b, h] ([s/tp,
    b, h] where the context splits the sequence); each rank looks up its own range, the results are summed."""
    tokens = tokens.t()
    if ctx.tp_size > 1:
        per_rank = weight.shape[0]
        start = ctx.tp_rank * per_rank
        outside = (tokens < start) | (tokens >= start + per_rank)
        local = (tokens - start).masked_fill(outside, 0)
        out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        out = F.embedding(tokens, weight)
    return mappings.exit_tp(out, ctx)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim; replicated over TP (partial grads under sequence parallelism, or,
    `per_head`, wherever TP splits the heads it normalises)."""

    def __init__(self, hidden, ctx, kind="LayerNorm", eps=1e-5, device=None, dtype=None, per_head=False):
        super().__init__()
        self.kind, self.eps = kind, eps
        partial = {"tp_partial_grad": True} if per_head else {"sp_partial_grad": True}
        self.weight = make_param((hidden,), None, ctx, ("ones",), device, dtype, **partial)
        self.bias = make_param((hidden,), None, ctx, ("zeros",), device, dtype, **partial) \
            if kind == "LayerNorm" else None

    def forward(self, x):
        if self.kind == "RMSNorm":
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.layer_norm(x, self.weight, self.bias, self.eps)

    def add(self, x, residual):
        """(norm(x + residual), x + residual), fused into one pass where a kernel does it."""
        if self.kind == "RMSNorm":
            return dispatch.add_rms_norm(x, residual, self.weight, self.eps)
        return dispatch.add_layer_norm(x, residual, self.weight, self.bias, self.eps)

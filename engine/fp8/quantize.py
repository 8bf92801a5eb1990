"""FP8 numbers: the two formats, scales from amaxes, and tensors quantized with one scale or one per tile.

A `Quantized` tensor is the FP8 data and the decode scale (`scale_inv`, what `torch._scaled_mm` takes): one
scalar, or one per tile of `tile` = (rows, cols) (1x128 activation and gradient tiles, 128x128 weight tiles,
DeepSeek-V3's and Megatron-LM's blockwise recipe; a last partial tile holds what is left). Scales follow
Transformer Engine: scale = fp8_max / amax / 2^margin (an amax of zero or not finite scales by 1); tile scales
are rounded down to a power of two, so dequantizing them is exact. Values beyond the format's range saturate.

A tiled tensor may be one rank's part of a tensor split over a group along `split.axis` (tp): its tiles are
then counted from the full tensor's origin and each tile's amax is the maximum over every rank holding a part
of it, so every layout quantizes the full tensor exactly as one rank does.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Optional

import torch

from engine.parallel import comm
from kernels import dispatch, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_dtype(fmt: str, gradient: bool):
    """e4m3 everywhere, or under `hybrid` e4m3 forward and e5m2 for the gradients (wider range, less precision)."""
    return E5M2 if gradient and fmt == "hybrid" else E4M3


def fp8_max(dtype) -> float:
    return torch.finfo(dtype).max


def scale_of(amax: torch.Tensor, dtype, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """The encode scale for an amax (any shape): fp8_max / amax / 2^margin, 1 where amax is 0 or not finite
    (kernels.reference.fp8_scale, the rule's one place). `dtype`: the FP8 format, or a tensor of formats' largest
    values, one per amax (several scalers at once)."""
    return reference.fp8_scale(amax, dtype if isinstance(dtype, torch.Tensor) else fp8_max(dtype), margin, pow2)


@dataclass(frozen=True)
class Split:
    """This rank's part of a tensor split over `group` along `axis`: `positions` [n] are its rows' (axis 0) or
    columns' (axis 1) places in the full tensor, which has `full` of them."""
    axis: int
    positions: torch.Tensor
    full: int
    group: object


@dataclass
class Quantized:
    data: torch.Tensor                      # FP8, 2-D
    scale_inv: torch.Tensor                 # fp32: a scalar, or one per tile [tile rows, tile columns]
    tile_of: Optional[tuple] = None         # per-tile: (each row's tile row [M], each column's tile column [K])
    transposed: Optional["Quantized"] = None  # the transpose, when it was made with the codes (`codes_of`)

    def dequantize(self) -> torch.Tensor:
        """fp32 values (exactly data x scale_inv; with power-of-two tile scales no rounding at all)."""
        if self.tile_of is None:
            return self.data.float() * self.scale_inv
        return self.data.float() * self.scale_inv[self.tile_of[0]][:, self.tile_of[1]]

    def t(self) -> "Quantized":
        """The transpose (its tiles transposed with it), contiguous: the layout a GEMM wants."""
        if self.transposed is not None:
            return self.transposed
        if self.tile_of is None:
            return Quantized(self.data.t().contiguous(), self.scale_inv)
        return Quantized(self.data.t().contiguous(), self.scale_inv.t(), self.tile_of[::-1])


def _cast_ops(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return reference.fp8_cast(x, scale, dtype)


@functools.lru_cache(maxsize=None)
def _fused_cast(dtype, scale_dims: int):
    """_cast_ops as one kernel (inductor's): eager PyTorch runs it as four passes over the tensor with an fp32
    copy between them, about 30 bytes moved per element where 3 are needed. On the H100 of 2026-11-26 the 1.3B
    step in FP8 ran at 0.56x bf16's with the eager casts, and the 8192³ FP8 GEMM with both operands cast per
    call at 418 TFLOP/s against 1,378 without (benchmarks/results/NOTES.md). Built on first use on CUDA.

    One compiled function per FP8 format and scale shape (a scalar, or one broadcast along x), each over its own
    copy of _cast_ops' code: dynamo keeps at most `recompile_limit` (8) compiled versions per code object and past
    that runs the function eagerly, saying so only in a log line. One shared function saw every operand kind (two
    formats x scalar or tile scales x bf16 or fp32 x row- or column-major, and the autograd flag before its
    input was detached) and hit that limit in the H200 run of 2026-11-26, whose FP8 step fell to 0.45x bf16's.
    Each copy now sees only x's dtype and layout (at most 4 versions)."""
    del dtype, scale_dims  # the cache's key: each pair gets its own code object, hence its own dynamo cache
    code = _cast_ops.__code__.replace()
    return torch.compile(types.FunctionType(code, _cast_ops.__globals__, _cast_ops.__name__), dynamic=True)


def _amax_ops(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax().float()


@functools.lru_cache(maxsize=None)
def _fused_amax():
    """_amax_ops as one reduction (inductor's), without the |x| copy eager makes; the largest magnitude is exact in
    any dtype, so it equals the eager one. (torch.linalg.vector_norm(x, inf) would also skip the copy, but on the
    CPU it ran 6-18x slower than abs().amax() here.)"""
    return torch.compile(_amax_ops, dynamic=True)


FUSE_CASTS_ON_CUDA = True  # False: the eager ops on CUDA too (to compare a run with and without)
# False: each input and output gradient cast as before 2026-11-27 (an amax pass, the cast, the transpose apart) and
# SwiGLU's tensors made in bf16 and then cast (engine.fp8.mlp not taken: read when a model is built), to compare a
# run with and without the one-pass codes (benchmarks/gpu/fp8.py); the same numbers either way
ONE_PASS_CODES = True


def one_pass() -> bool:
    """Whether inputs and gradients are quantized with their transpose in one pass (ONE_PASS_CODES)."""
    return ONE_PASS_CODES


def _fused(x: torch.Tensor) -> bool:
    """Whether x's amax and cast run as inductor's kernels: on CUDA, unless a compiler is already tracing."""
    return FUSE_CASTS_ON_CUDA and x.is_cuda and not torch.compiler.is_compiling()


def cast(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """x's FP8 codes under encode `scale` (a scalar, or one broadcast along x: one per tile's elements, per row):
    fp32(x) * scale, saturated to the format's range, rounded to it (to nearest, ties to even); the data
    `quantize` and `quantize_tiles` store, element by element the same for any such layout."""
    if _fused(x):
        # detached: the codes carry no gradient, and x's autograd flag or view base would be guarded on
        return _fused_cast(dtype, scale.dim())(x.detach(), scale, dtype)
    return _cast_ops(x, scale, dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype, scale_inv: Optional[torch.Tensor] = None) -> Quantized:
    """x [M, K] with one encode scale; `scale_inv`: its reciprocal where already known."""
    scale = scale.float().reshape(())
    return Quantized(cast(x, scale, dtype), scale.reciprocal() if scale_inv is None else scale_inv)


def both_ways(codes: torch.Tensor, codes_t: torch.Tensor, scale_inv: torch.Tensor) -> Quantized:
    """A tensor's codes [M, K] under one encode scale, whose reciprocal is `scale_inv`, with their transpose [K, M],
    made together."""
    return Quantized(codes, scale_inv, transposed=Quantized(codes_t, scale_inv))


def codes_of(x: torch.Tensor, scale: torch.Tensor, dtype, want_amax: bool, scale_inv: torch.Tensor,
             into: Optional[torch.Tensor] = None) -> tuple:
    """(x [M, K] quantized as `quantize` does with its transpose attached, x's amax or None): one pass over x on
    CUDA (kernels.fp8_triton), the same codes and amax; for a tensor two GEMMs take, once transposed. `scale`: the
    encode scale, or a kernels.reference.FromAmax to derive it from; `scale_inv`: 1 / scale; `into`: a running amax
    x's is max-ed into in place (then the amax returned is `into`)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.float().reshape(())
    codes, codes_t, now = dispatch.fp8_codes(x, scale, dtype, want_amax, into)
    return both_ways(codes, codes_t, scale_inv), now


def amax(x: torch.Tensor, group=None) -> torch.Tensor:
    """max |x| over this tensor, and over `group` when its ranks hold the other parts of it (fp32, a scalar)."""
    if not x.numel():
        a = torch.zeros((), device=x.device)
    elif _fused(x):
        a = _fused_amax()(x.detach())
    else:
        a = _amax_ops(x.detach())
    return group_amax(a, group)


def group_amax(a: torch.Tensor, group=None) -> torch.Tensor:
    """The scalar amax `a` of this rank's part of a tensor, the largest over `group` (its other parts' ranks)."""
    if group is not None:
        a = a.reshape(1)
        comm.all_reduce(a, group, op=comm.ReduceOp.MAX)
        a = a.reshape(())
    return a


def _tile_amax(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, grid_shape: tuple) -> torch.Tensor:
    """max |x| per tile, element (i, j) in tile (rows[i], cols[j]) of a grid `grid_shape` (untouched tiles 0)."""
    a = x.detach().abs().float()
    by_col = torch.zeros((a.shape[0], grid_shape[1]), device=a.device)
    by_col.scatter_reduce_(1, cols.unsqueeze(0).expand_as(a), a, "amax")
    grid = torch.zeros(grid_shape, device=a.device)
    grid.scatter_reduce_(0, rows.unsqueeze(1).expand_as(by_col), by_col, "amax")
    return grid


def quantize_tiles(x: torch.Tensor, tile: tuple, dtype, margin: int = 0, split: Optional[Split] = None) -> Quantized:
    """x [M, K] with one power-of-two scale per `tile` (rows, cols) of the full tensor (a last partial tile
    holds what is left); `split`: x is one rank's part of the full tensor, whose tiles its group shares."""
    places = [torch.arange(n, device=x.device) for n in x.shape]
    full = list(x.shape)
    if split is not None:
        places[split.axis], full[split.axis] = split.positions.to(x.device), split.full
    tile_of = tuple(p // t for p, t in zip(places, tile))
    grid = _tile_amax(x, *tile_of, tuple((n + t - 1) // t for n, t in zip(full, tile)))
    if split is not None and comm.world_size(split.group) > 1:
        comm.all_reduce(grid, split.group, op=comm.ReduceOp.MAX)
    scale = scale_of(grid, dtype, margin, pow2=True)
    return Quantized(cast(x, scale[tile_of[0]][:, tile_of[1]], dtype), scale.reciprocal(), tile_of)

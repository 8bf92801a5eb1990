"""The FP8 GEMM: a @ b^T of two quantized operands, both stored along the contraction dimension.

On CUDA, tensor-scaled operands whose sizes suit the tensor cores (multiples of 16) go through
`torch._scaled_mm` (FP8 tensor cores, fp32 accumulation). Everywhere else the operands are dequantized and
multiplied at fp32, b laid out [K, N] contiguous: that is what torch's CPU `_scaled_mm` does (bitwise equal at
every shape tried, tests/test_fp8.py; with b^T left a strided view the BLAS sums some small shapes in another
order), so the CPU path computes the oracle's numbers without its per-call overhead. Tile-scaled
operands are dequantized on CUDA too, to bf16 in a bf16 run (exact: FP8 values times power-of-two scales), so
those GEMMs run at the bf16 rate with FP8's numbers, not faster.

`mm_kn` is the experts' product, a [M, K] @ b [K, N] with b as the expert holds it. Where both operands' scales
are constant along K (a per token, b one per expert) it is what `torch._scaled_mm` computes with row-wise
scales (scale_a [M, 1], scale_b [1, N]); on CUDA, for e4m3 operands and a bf16 result (the Hopper row-wise
kernel's case), it runs there, on the FP8 tensor cores. torch's CPU `_scaled_mm` gives the dequantized product
bit for bit with such scales (tests/test_fp8.py), which is the CPU path.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from engine.fp8.quantize import E4M3, Quantized


def _tensor_cores(a: Quantized, b: Quantized) -> bool:
    if not a.data.is_cuda or a.tile_of is not None or b.tile_of is not None:
        return False
    return all(n % 16 == 0 for n in (*a.data.shape, b.data.shape[0])) and a.data.shape[0] > 0


def operand(q: Quantized, out_dtype) -> torch.Tensor:
    """The dequantized values to multiply: fp32, or on CUDA for a bf16 result bf16 when that is exact (FP8 values
    times power-of-two tile scales fit bf16's 8 bits), so cuBLAS multiplies them at the bf16 rate."""
    exact_bf16 = q.data.is_cuda and out_dtype == torch.bfloat16 and q.tile_of is not None
    return q.dequantize().to(torch.bfloat16) if exact_bf16 else q.dequantize()


def mm(a: Quantized, b: Quantized, out_dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in `out_dtype`."""
    if _tensor_cores(a, b):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype)
    return operand(a, out_dtype).matmul(operand(b, out_dtype).t().contiguous()).to(out_dtype)


ROWWISE_ON_CUDA = True  # False: the experts' GEMMs dequantized on CUDA too (to compare a run with and without)


def _scales_along(q: Quantized, axis: int) -> Optional[torch.Tensor]:
    """q's decode scales, one per index of `axis` (0: per row [rows, 1]; 1: per column [1, cols]), when they do not
    vary along the other axis (one scale, or tiles spanning it whole); else None."""
    n = q.data.shape[axis]
    if q.tile_of is None:
        scale = q.scale_inv.reshape(1, 1)
    elif q.scale_inv.shape[1 - axis] != 1:
        return None
    else:
        scale = q.scale_inv[q.tile_of[0]] if axis == 0 else q.scale_inv[:, q.tile_of[1]]
    return scale.expand((n, 1) if axis == 0 else (1, n)).contiguous().float()


def _row_scaled_cores(a: Quantized, b: Quantized, out_dtype) -> bool:
    return (ROWWISE_ON_CUDA and a.data.is_cuda and out_dtype == torch.bfloat16 and a.data.dtype == E4M3
            and b.data.dtype == E4M3 and a.data.shape[0] > 0  # any number of tokens; K and N multiples of 16
            and a.data.shape[1] % 16 == 0 and b.data.shape[1] % 16 == 0 and _row_scaled_runs(a.data.device))


@functools.lru_cache(maxsize=None)
def _row_scaled_runs(device: torch.device) -> bool:
    """Whether this torch build runs row-wise scaled FP8 GEMMs on `device` (its CUTLASS kernel is built for sm_89
    and sm_90 only): tried once on a 16 x 16 product; if not, one warning and the dequantized path."""
    a = torch.zeros((16, 16), dtype=E4M3, device=device)
    ones_a, ones_b = torch.ones((16, 1), device=device), torch.ones((1, 16), device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16)
        return True
    except RuntimeError as exc:
        warnings.warn(f"FP8 experts: row-wise scaled GEMMs do not run on {device} with this torch build "
                      f"({str(exc).splitlines()[0]}); the experts' GEMMs run dequantized at the bf16 rate")
        return False


def row_scaled(a: Quantized, b: Quantized, out_dtype) -> Optional[torch.Tensor]:
    """a [M, K] @ b [K, N] through `torch._scaled_mm` with row-wise scales, or None when their scales vary along K.
    b may be a transposed view (column-major, as `_scaled_mm` takes its second operand); else it is laid out so."""
    scale_a, scale_b = _scales_along(a, 0), _scales_along(b, 1)
    if scale_a is None or scale_b is None:
        return None
    second = b.data if b.data.stride(0) == 1 else b.data.t().contiguous().t()
    return torch._scaled_mm(a.data, second, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def mm_kn(a: Quantized, b: Quantized, out_dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in `out_dtype`: row-wise scaled FP8 tensor cores where they take the operands
    (CUDA, above), else the dequantized product (exact values, fp32, or bf16 on CUDA)."""
    if _row_scaled_cores(a, b, out_dtype):
        out = row_scaled(a, b, out_dtype)
        if out is not None:
            return out
    return operand(a, out_dtype).matmul(operand(b, out_dtype))

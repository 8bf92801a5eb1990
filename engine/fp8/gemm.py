"""The FP8 GEMM: a @ b^T of two quantized operands, both stored along the contraction dimension.

On CUDA, tensor-scaled operands whose sizes suit the tensor cores (multiples of 16) go through
`torch._scaled_mm` (FP8 tensor cores, fp32 accumulation). Everywhere else the operands are dequantized and
multiplied at fp32, b laid out [K, N] contiguous: that is what torch's CPU `_scaled_mm` does (bitwise equal at
every shape tried, tests/test_fp8.py; with b^T left a strided view the BLAS sums some small shapes in another
order), so the CPU path computes the oracle's numbers without its per-call overhead. Tile-scaled
operands are dequantized on CUDA too, to bf16 in a bf16 run (exact: FP8 values times power-of-two scales), so
those GEMMs run at the bf16 rate with FP8's numbers, not faster.
"""
from __future__ import annotations

import torch

from engine.fp8.quantize import Quantized


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

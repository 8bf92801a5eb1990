"""SwiGLU, silu(gate) * up, in Triton.

Inputs are viewed as [rows, h] with any row stride, so the two halves of a fused gate/up projection
(`torch.chunk(x, 2, -1)`) are read in place without a copy. Backward recomputes the sigmoid instead of
saving it, trading a few flops for one fewer activation-sized buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(G, U, Y, stride_g, stride_u, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * H + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, stride_g, stride_u, stride_dy, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g)/dg = sig * (1 + g * (1 - sig)).
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * H + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * H + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        if gate.shape != up.shape:
            raise ValueError(f"swiglu needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
        g2, u2 = _rows(gate), _rows(up)
        m, h = g2.shape
        y = torch.empty((m, h), dtype=gate.dtype, device=gate.device)
        _swiglu_fwd[(m, triton.cdiv(h, BLOCK))](g2, u2, y, g2.stride(0), u2.stride(0), h, BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        m, h = g2.shape
        dy2 = _rows(dy)
        dg = torch.empty((m, h), dtype=g2.dtype, device=g2.device)
        du = torch.empty((m, h), dtype=u2.dtype, device=u2.device)
        _swiglu_bwd[(m, triton.cdiv(h, BLOCK))](g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), dy2.stride(0), h,
                                                BLOCK=BLOCK, num_warps=4)
        return dg.view(ctx.shape), du.view(ctx.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)

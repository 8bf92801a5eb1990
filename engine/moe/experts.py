"""The routed experts of one MoE layer as stacked weights, run as one grouped GEMM.

fc1 is [E, h, F1] (F1 = 2F with SwiGLU: gate then up) and fc2 [E, F, h], split over the expert-parallel
group on axis 0 (global expert ids: rank r holds experts r*E/ep ..). Tokens arrive grouped by local
expert; `grouped_matmul` multiplies each group by its expert's matrix with `torch._grouped_mm` where
this torch has it and the shapes suit it (rows 16-byte aligned), else a loop over the experts: the same
numbers (tests/test_moe.py checks both, forward and backward).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.layers import make_param
from kernels import dispatch


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:
        return False  # the CUDA kernel takes bf16 only
    aligned = lambda n: (n * x.element_size()) % 16 == 0  # noqa: E731
    return aligned(x.shape[1]) and aligned(w.shape[-1]) and x.dtype == w.dtype


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list, grouped: bool = True) -> torch.Tensor:
    """Rows of x [N, K] grouped in len(sizes) runs; run i times w[i] [K, M] -> [N, M]."""
    if grouped and _grouped_ok(x, w):
        offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    outs, start = [], 0
    for i, n in enumerate(sizes):
        outs.append(x[start:start + n] @ w[i])
        start += n
    return torch.cat(outs) if outs else x.new_empty((0, w.shape[-1]))


class Experts(nn.Module):
    fp8 = None  # the FP8 grouped GEMM (engine.fp8.attach gives it when a run trains in FP8)

    def __init__(self, cfg, ctx, out_std: float, device=None, dtype=None):
        super().__init__()
        E, h, f = cfg.num_experts, cfg.hidden_size, cfg.resolved_moe_ffn_hidden_size()
        self.swiglu, self.gelu_form, self.ffn = cfg.swiglu, "tanh" if cfg.openai_gelu else "none", f
        self.local = E // ctx.ep_size
        # Each tp rank (under SP) sends its own tokens: its gradient is partial, summed over tp.
        common = dict(ep_axis=0, sp_partial_grad=True, matrix="experts")
        self.fc1 = make_param((E, h, 2 * f if cfg.swiglu else f), None, ctx, ("normal", cfg.init_method_std),
                              device, dtype, **common)
        self.fc2 = make_param((E, f, h), None, ctx, ("normal", out_std), device, dtype, **common)
        self.grouped = True

    def forward(self, x: torch.Tensor, sizes: list) -> torch.Tensor:
        """x [N, h]: tokens grouped by local expert, sizes[i] of them for expert i."""
        mm = self.fp8 or (lambda a, w, n: grouped_matmul(a, w, n, self.grouped))
        y = mm(x, self.fc1, sizes)
        if self.swiglu:
            y = dispatch.swiglu_stacked(y)
        else:
            y = F.gelu(y, approximate=self.gelu_form)
        return mm(y, self.fc2, sizes)

    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one token through one expert (the planner counts top-k of these)."""
        return 2 * math.prod(self.fc1.shape[1:]) + 2 * math.prod(self.fc2.shape[1:])

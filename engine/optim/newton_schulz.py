"""Muon's arithmetic on one weight: the Newton-Schulz orthogonalisation, the update's scale, and which
matrices a weight is made of. No communication: engine/optim/muon_plan.py brings each weight whole to the
rank that orthogonalises it, engine/optim/muon.py runs the step.

Newton-Schulz (Jordan et al. 2024, "Muon"; Megatron-Core's emerging_optimizers): X <- M / ||M||_F, then
per step with coefficients (a, b, c): A = X X^T, X <- a X + (b A + c A^2) X, on the orientation whose Gram
matrix is the smaller (a tall matrix is transposed first). It drives every singular value of M towards 1
(roughly: the iteration is tuned for speed, not convergence), i.e. towards U V^T of M = U S V^T.
`--muon-coefficient-type simple` repeats (3.4445, -4.775, 2.0315) at every step, as torch.optim.Muon does;
`quintic` (the default) is Megatron-Core's schedule of five tuples, repeated for 10, 15, ... steps.
`--muon-fp32-matmul-prec medium` (Megatron's default; `low` is the same here) runs the iteration in bf16 after
normalising in fp32; `high` keeps it in fp32 (the tests compare in fp32: bf16 turns rounding noise into
percent-level differences between layouts).

The orthogonalised update is scaled per matrix of out x in (`--muon-scale-mode`): spectral sqrt(max(out, in)),
unit_rms_norm sqrt(out / in), shape_scaling sqrt(max(1, out / in)) (torch.optim.Muon's "original"), times
`--muon-extra-scale-factor` (0.2 with spectral is torch's "match_rms_adamw").

What a weight is made of (its ParamSpec.matrix, set by the layer that owns it): a linear's [out, in] is one
matrix, SwiGLU's stacked [2, F, in] one [2F, in] matrix (as Megatron-Core orthogonalises linear_fc1); the
fused QKV [g x (q, k, v) rows, in] is three, all q rows, all k rows and all v rows (`row_blocks`), unless
`--muon-no-split-qkv`; a routed expert stack [E, in, out] is one [out, in] matrix per expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config.fields import MUON_COEFFICIENTS

COEFFICIENTS = {
    "simple": ((3.4445, -4.775, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
}
assert {name: len(sets) for name, sets in COEFFICIENTS.items()} == MUON_COEFFICIENTS
EPS = 1e-7  # the Frobenius norm is clamped to this before dividing (torch.optim.Muon's and Megatron's)


@dataclass(frozen=True)
class MuonSettings:
    """Muon's flags as the step reads them, resolved once (no module compares the flags' names)."""
    momentum: float = 0.9
    nesterov: bool = False
    coefficients: tuple = COEFFICIENTS["quintic"]  # one (a, b, c) per Newton-Schulz step
    scale_mode: str = "spectral"
    extra_scale: float = 1.0
    bf16: bool = True          # the iteration's matmuls in bf16 (--muon-fp32-matmul-prec low/medium)
    whole_over_tp: bool = False  # tp-split matrices orthogonalised whole (duplicated, distributed), not per shard
    spread_over_tp: bool = False  # ... each by one tp rank, the result scattered (distributed)
    split_qkv: bool = True
    weight_decay: float = 0.01

    @classmethod
    def of(cls, opt) -> "MuonSettings":
        """From the optimizer section (engine.config.OptimizerConfig), validated (engine/validation.py)."""
        table = COEFFICIENTS[opt.muon_coefficient_type]
        steps = [table[i % len(table)] for i in range(opt.muon_num_ns_steps)]
        return cls(opt.muon_momentum, opt.muon_nesterov, tuple(steps), opt.muon_scale_mode,
                   opt.muon_extra_scale_factor, opt.muon_fp32_matmul_prec != "high",
                   opt.muon_tp_mode != "blockwise", opt.muon_tp_mode == "distributed", not opt.muon_no_split_qkv,
                   opt.weight_decay)

    def describe(self) -> str:
        """The settings in words, for the start-up banner."""
        kind = "simple" if self.coefficients[0] == COEFFICIENTS["simple"][0] else "quintic"
        return (f"momentum {self.momentum}{' (Nesterov)' if self.nesterov else ''}, {len(self.coefficients)} "
                f"Newton-Schulz steps ({kind}, {'bf16' if self.bf16 else 'fp32'}), scale {self.scale_mode}"
                f"{f' x {self.extra_scale:g}' if self.extra_scale != 1 else ''}, weight decay {self.weight_decay:g}")


def newton_schulz(m: torch.Tensor, coefficients: tuple, bf16: bool) -> torch.Tensor:
    """The orthogonalised fp32 matrix of `m` (2-D), by len(coefficients) Newton-Schulz steps."""
    tall = m.shape[0] > m.shape[1]
    x = m.float().T if tall else m.float()
    x = x / x.norm().clamp_min(EPS)
    if bf16:
        x = x.bfloat16()
    for a, b, c in coefficients:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.float()
    return x.T if tall else x


def scale(out: int, inp: int, mode: str) -> float:
    """The update's scale for an out x in matrix (module docstring)."""
    if mode == "spectral":
        return math.sqrt(max(out, inp))
    if mode == "unit_rms_norm":
        return math.sqrt(out / inp)
    return math.sqrt(max(1.0, out / inp))


def newton_schulz_flops(out: int, inp: int, steps: int) -> int:
    """Multiply-adds x 2 of `steps` Newton-Schulz steps on an out x in matrix: with m <= n its sides, per step
    X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n)."""
    m, n = min(out, inp), max(out, inp)
    return steps * (4 * m * m * n + 2 * m ** 3)


def blocks(t: torch.Tensor, spec, split_qkv: bool) -> list:
    """Views of `t` (a weight, its tp shard or one expert of a stack; contiguous) holding one matrix each: an
    expert's [out, in], a linear's [rows, in], or QKV's [groups, rows, in] per q, k, v block."""
    if spec.matrix == "experts":
        return [e.T for e in t.reshape(-1, *t.shape[-2:])]
    m = t.reshape(-1, t.shape[-1])
    if not (split_qkv and spec.row_blocks):
        return [m]
    groups, edges = m.view(-1, sum(spec.row_blocks), m.shape[-1]), [0]
    for rows in spec.row_blocks:
        edges.append(edges[-1] + rows)
    return [groups[:, lo:hi] for lo, hi in zip(edges, edges[1:])]


def matrix_shapes(shape: tuple, spec, split_qkv: bool) -> list:
    """(out, in) of each matrix of a weight of `shape` (its full shape, or a shard's): for the FLOPs count."""
    return [(b.numel() // b.shape[-1], b.shape[-1]) for b in blocks(torch.empty(shape, device="meta"), spec, split_qkv)]


def orthogonalize(t: torch.Tensor, spec, settings: MuonSettings) -> torch.Tensor:
    """Muon's update direction for weight-shaped `t` (the momentum, or its Nesterov look-ahead): each matrix
    orthogonalised and scaled, put back in `t`'s shape (fp32)."""
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    for source, target in zip(blocks(t, spec, settings.split_qkv), blocks(out, spec, settings.split_qkv)):
        o = newton_schulz(source.reshape(-1, source.shape[-1]), settings.coefficients, settings.bf16)
        target.copy_(o.mul_(scale(*o.shape, settings.scale_mode) * settings.extra_scale).view(target.shape))
    return out

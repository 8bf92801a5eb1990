"""FP8 for the routed experts' grouped GEMM: one scale per expert for its weights, one per token for the inputs.

An expert's inputs come from every rank of its expert-parallel group at once, from several microbatches, so a
scale over its whole input would change with the layout. Its inputs and output gradients are therefore scaled
per token (a row: one scale under tensor scaling, 1x128 tiles under blockwise), which no layout changes, and
its weights per expert (one scale, or 128x128 tiles; delayed scaling uses the expert's current amax: its
weights are whole on every rank that holds them). The weight gradient contracts over tokens and reuses the
per-token operands. Forward and the input gradient go through engine.fp8.gemm.mm_kn: under tensor scaling with
e4m3 operands on CUDA (`--fp8-format e4m3`; hybrid's e5m2 gradients are not taken by the row-wise kernel) they run
on the FP8 tensor cores with row-wise scales; otherwise, and always for the weight gradient (its per-token scales
vary along the tokens it sums over), dequantized (engine.fp8.gemm.operand: fp32, or bf16 on CUDA in a bf16 run,
both exact), at the bf16 rate with FP8's numbers.

Under `--fp8-param-gather` (tensor scaling) a stacked weight arrives quantized: the optimizer's all-gather
(engine.optim.fp8_codes, `ExpertCodes`) quantizes each replica's shard with each expert's scale from the amax of
its whole weight (MAX-reduced over the replicas) and gathers the codes; `gathered` holds them per weight
(`GatheredExperts`) until the weight changes (its version counter; no history moves these scales), and forward
takes them instead of quantizing: per expert the codes and scale `weight` makes, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.fp8.gemm import mm_kn, operand
from engine.fp8.quantize import Quantized, fp8_dtype, quantize_tiles, scale_of
from engine.fp8.scaling import ACTIVATION_TILE, WEIGHT_TILE, Recipe
from kernels.reference import cast_to


@dataclass
class GatheredExperts:
    """A stacked expert weight's operands, one per expert as `Fp8Experts.weight` makes it (from the optimizer's
    gather, or made here and held for a step's schedule), and the weight's version they hold for."""
    q: list
    version: int


class Fp8Experts:
    def __init__(self, recipe: Recipe, may_hold: bool = True):
        self.recipe = recipe
        self.gathered = {}  # id(stacked weight) -> GatheredExperts under --fp8-param-gather
        # Within a step's schedule (engine.fp8.weights_held), as the linears do: each expert's Q(w) made once for
        # all the microbatches; not under ZeRO-3 (False), which keeps no whole weight between its unit gathers.
        self.may_hold, self.holding, self.held = may_hold, False, {}

    def rows(self, x: torch.Tensor, gradient: bool):
        tile = ACTIVATION_TILE if self.recipe.blockwise else (1, max(x.shape[1], 1))
        return quantize_tiles(x, tile, fp8_dtype(self.recipe.fmt, gradient), self.recipe.margin)

    def weight(self, w: torch.Tensor):
        tile = WEIGHT_TILE if self.recipe.blockwise else tuple(max(n, 1) for n in w.shape)
        return quantize_tiles(w, tile, fp8_dtype(self.recipe.fmt, False), self.recipe.margin)

    def hold(self, on: bool) -> None:
        """Keep (on) or drop (off) the Q(w) made within a step's schedule."""
        self.holding, self.held = on, self.held if on else {}

    def weights(self, w: torch.Tensor, n: int) -> list:
        """Forward's Q(w[i]) of the first n experts: the gathered codes while they hold, else quantized here."""
        for kept in (self.gathered, self.held):
            g = kept.get(id(w))
            if g is not None and g.version == w._version:
                return g.q[:n]
        q = [self.weight(w[i]) for i in range(n)]
        if self.holding:
            self.held[id(w)] = GatheredExperts(q, w._version)
        return q

    def encode_scales(self, amaxes: torch.Tensor) -> torch.Tensor:
        """Tensor scaling: the encode scale `weight` takes for each expert whose whole weight's amax is amaxes[i].
        On the CPU one expert at a time, as `weight` computes its one-element grid: torch's CPU kernels run a long
        tensor through vectorized (SIMD) code and a single element through scalar code, whose log2 may differ in
        the last bit with some builds (not this one's, on 200,000 values and every power of two's neighbour); a
        CUDA kernel runs the same code on every element, so there all at once."""
        if self.recipe.blockwise:
            raise ValueError("blockwise experts' weights have 128x128 tile scales, not one per expert")
        dtype, margin = fp8_dtype(self.recipe.fmt, False), self.recipe.margin
        if amaxes.is_cuda or not len(amaxes):
            return scale_of(amaxes, dtype, margin, pow2=True)
        return torch.cat([scale_of(a.reshape(1), dtype, margin, pow2=True) for a in amaxes])

    def operand(self, data: torch.Tensor, scale: torch.Tensor, tile_of: tuple) -> Quantized:
        """An expert's Q(w) from its codes [K, N] and encode scale, as `weight` makes it (`tile_of`: one tile over
        all of it, `single_tile(K, N)`, shared by the experts of a weight)."""
        return Quantized(data, scale.reshape(1, 1).reciprocal(), tile_of)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, sizes: list) -> torch.Tensor:
        """Rows of x [N, K] grouped in len(sizes) runs; run i times w[i] [K, M] -> [N, M]."""
        return _GroupedFn.apply(x, w, list(sizes), self)


class _GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, sizes, fp8: Fp8Experts):
        xq = [fp8.rows(part, False) for part in x.split(sizes)]
        wq = fp8.weights(w, len(sizes))
        ctx.saved, ctx.fp8, ctx.sizes, ctx.w_dtype = (xq, wq), fp8, sizes, w.dtype
        out = [mm_kn(a, b, x.dtype) for a, b in zip(xq, wq)]
        return cast_to(torch.cat(out), x.dtype) if out else x.new_empty((0, w.shape[-1]))

    @staticmethod
    def backward(ctx, dy):
        (xq, wq), fp8 = ctx.saved, ctx.fp8
        dyq = [fp8.rows(part, True) for part in dy.split(ctx.sizes)]
        dx = [mm_kn(g, _transposed_view(b), dy.dtype) for g, b in zip(dyq, wq)]
        dw = torch.stack([operand(a, dy.dtype).t().matmul(operand(g, dy.dtype)) for a, g in zip(xq, dyq)])
        return torch.cat(dx).to(dy.dtype), dw.to(ctx.w_dtype), None, None


def _transposed_view(q: Quantized) -> Quantized:
    """q^T without a copy (column-major: what `_scaled_mm` takes as its second operand)."""
    return Quantized(q.data.t(), q.scale_inv.t(), None if q.tile_of is None else q.tile_of[::-1])


def single_tile(rows: int, cols: int, device=None) -> tuple:
    """`Quantized.tile_of` of a [rows, cols] tensor scaled as one tile (every row and column in tile 0)."""
    return (torch.zeros(rows, dtype=torch.long, device=device), torch.zeros(cols, dtype=torch.long, device=device))

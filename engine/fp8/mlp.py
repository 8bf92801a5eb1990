"""The FP8 SwiGLU MLP: fc1, SwiGLU and fc2 inside the tensor-parallel region as one autograd function, SwiGLU's
output and its input gradient made as FP8 codes where they are computed.

Apart (fc1's FP8 linear, SwiGLU, fc2's), SwiGLU writes its output in bf16, fc2 reads it for its amax, again to
cast it, and its codes to transpose them; backward does the same with SwiGLU's input gradient for fc1. Those two
tensors are 65% of the elements a step casts on a Llama-shaped model (ffn 4x hidden: 24,576 of 37,888 a token
and layer; benchmarks/results/NOTES.md section 8). Here kernels.dispatch.swiglu_fp8 and swiglu_grad_fp8 read
gate and up (and the output gradient) and write the codes and their transpose at once (on CUDA one Triton kernel
under delayed scaling, two under current scaling, which needs the whole tensor's amax first); the bf16 tensors
are never made. fc1's input, the weights and fc2's output gradient are quantized as by the linears apart.

The numbers are those of the three apart bit for bit: the same values cast under the same scales, the same
amaxes noted for the histories (tests/test_fp8.py). It holds the two linears' `Fp8Linear`s, whose scalers,
held or gathered weights and tensor-parallel groups it uses, so checkpoints, `weights_held` and
`--fp8-param-gather` see the linears as ever. engine.fp8.attach gives it to an MLP with SwiGLU and no biases
under tensor scaling (tensorwise, delayed); blockwise scales tiles that a tensor-parallel group shares and
keeps the three apart.
"""
from __future__ import annotations

import torch

from engine.fp8 import gemm
from engine.fp8.linear import Fp8Linear, entered_shape, scatter_seq
from engine.fp8.quantize import Quantized, both_ways, one_pass
from engine.fp8.scaling import Scaler
from engine.parallel.weight_grad_store import deferral_of
from kernels import dispatch


def _codes(scaler: Scaler, group, fused, *tensors) -> Quantized:
    """`fused`'s output (dispatch.swiglu_fp8 or swiglu_grad_fp8 over `tensors`) quantized by `scaler` as
    `Scaler.tensor(..., transposed=True)` would quantize it."""
    def make(scale):
        codes, codes_t, now = fused(*tensors, scale, scaler.dtype, scaler.from_history,
                                     scaler.running(tensors[0].device))
        return both_ways(codes, codes_t, scaler.decode(scale)), now

    q = scaler.produce(lambda: fused(*tensors, None, scaler.dtype, True)[2], make, group, derive=True)
    scaler.last = q.scale_inv
    return q


class Fp8SwiGLU:
    """fc2(swiglu(fc1(x))) in FP8 with SwiGLU's tensors as codes (x: fc1's input, entered into the tp region)."""

    def __init__(self, fc1: Fp8Linear, fc2: Fp8Linear):
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, x, w1, w2):
        """x into the tensor-parallel region as fc1's input enters it, the output out of it as fc2's leaves
        (`Fp8Linear.enter`, `leave`: under SP with their codes gathered, the input's and the output gradient's)."""
        d1, d2 = deferral_of(w1), deferral_of(w2)
        x, gather = self.fc1.entering(x)
        y = _Fp8SwiGLUFn.apply(x, w1 if d1 is None else w1.detach(), w2 if d2 is None else w2.detach(), self,
                               d1, d2, gather)
        return self.fc2.leaving(y, gather)


class _Fp8SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, mlp: Fp8SwiGLU, d1, d2, gather):
        """`gather`: x is this rank's sequence shard, its codes gathered over that group, and the output is
        reduce-scattered over it (its gradient's codes gathered in backward)."""
        fc1, fc2 = mlp.fc1, mlp.fc2
        x2 = x.reshape(-1, x.shape[-1])
        xq, w1q = fc1.operand("input", x2, gather), fc1.weight_operand(w1)
        h = gemm.mm(xq, w1q, x.dtype)  # [tokens, 2F]: gate, then up
        zq = _codes(fc2.input, fc2.group, dispatch.swiglu_fp8, *h.chunk(2, dim=-1))
        w2q = fc2.weight_operand(w2)
        y = gemm.mm(zq, w2q, x.dtype)
        ctx.h, ctx.xt, ctx.zt, ctx.w1q, ctx.w2q = h, xq.t(), zq.t(), w1q, w2q
        ctx.mlp, ctx.deferrals, ctx.gather = mlp, (d1, d2), gather
        x_shape = entered_shape(x, gather)
        ctx.shapes = (x_shape, (w1.shape, w1.dtype), (w2.shape, w2.dtype))
        return scatter_seq(y.view(*x_shape[:-1], y.shape[-1]), gather)

    @staticmethod
    def backward(ctx, dy):
        fc1, fc2 = ctx.mlp.fc1, ctx.mlp.fc2
        x_shape, (w1_shape, w1_dtype), (w2_shape, w2_dtype) = ctx.shapes
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq = fc2.operand("grad", dy2, ctx.gather)
        dz = gemm.mm(dyq, fc2.weight_transposed(ctx.w2q), dy.dtype)
        dyt, zt = dyq.t(), ctx.zt
        dhq = _codes(fc1.grad, fc1.group, dispatch.swiglu_grad_fp8, *ctx.h.chunk(2, dim=-1), dz)
        dht = dhq.t()
        dx = gemm.mm(dhq, fc1.weight_transposed(ctx.w1q), dy.dtype).view(x_shape) if ctx.needs_input_grad[0] else None
        xt = ctx.xt

        def fc2_grad():
            return gemm.mm(dyt, zt, w2_dtype).view(w2_shape)

        def fc1_grad():
            return gemm.mm(dht, xt, w1_dtype).view(w1_shape)

        dw = {}
        for i, grad in ((2, fc2_grad), (1, fc1_grad)):  # fc2's first, as backward reaches the linears apart
            dw[i] = grad() if ctx.needs_input_grad[i] else None
            deferral = ctx.deferrals[i - 1]
            if deferral is not None:  # a split backward's W pass computes it (the weight came in detached)
                param, store = deferral
                store.append((param, grad))
        return scatter_seq(dx, ctx.gather), dw[1], dw[2], None, None, None, None


def fusable(module) -> bool:
    """Whether `module` is an MLP this function can run: SwiGLU between a column- and a row-parallel linear, both
    in FP8 with tensor scaling and neither with a bias (`swiglu_between_linears`, engine.model.MLP); not when
    quantize.ONE_PASS_CODES is off."""
    if not (one_pass() and getattr(module, "swiglu_between_linears", False)):
        return False
    fc1, fc2 = module.fc1.fp8, module.fc2.fp8
    return isinstance(fc1, Fp8Linear) and isinstance(fc2, Fp8Linear) and not fc1.recipe.blockwise


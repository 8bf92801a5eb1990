"""The kernels that write FP8 codes (kernels/fp8_triton.py) against torch's cast, code for code.

Their integer FP8 conversion (the interpreter's is wrong) against torch's for every code, midpoint and special
value; a tensor's codes with their transpose in one pass, and SwiGLU's output and input gradient straight to codes,
against the values cast by kernels.reference.fp8_cast. Without a GPU under Triton's interpreter (test_kernels sets
it up), with one compiled, where the `gpu` case adds a 1.3B model's MLP size and the hardware's conversion.
"""
import pytest
import torch

import test_kernels as tk  # first: on CPU it points Triton at its interpreter before any kernel is defined
from kernels import dispatch, reference

DEVICE, _tk, _leaf, needs_triton, gpu_test = tk.DEVICE, tk._tk, tk._leaf, tk.needs_triton, tk.gpu_test

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

if dispatch.triton_available():
    import triton.language as tl
    from triton import jit

    from kernels.fp8_triton import _fp8_bits

    @jit
    def _fp8_codes(X, C, n, M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, B: tl.constexpr):
        """C[i] = the FP8 code _fp8_bits makes of X[i]."""
        o = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(C + o, _fp8_bits(tl.load(X + o, mask=o < n, other=0.0), M, BIAS, TOP), mask=o < n)


def _bits(t):
    return t.view(torch.uint8)


def _same(a, b):
    """Equal, NaN to NaN."""
    return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("fp8", FP8)
def test_the_fp8_code_arithmetic_is_torch_conversion(fp8):
    """fp8_triton._fp8_bits (integer arithmetic, not the language's conversion, which Triton's interpreter
    gets wrong) gives torch's code after the saturating clamp for every FP8 value, every midpoint between two
    neighbours and the fp32 values next to it (ties to even), values beyond the range, tiny ones, zeros, inf, NaN."""
    mantissa, bias = _tk("fp8_triton")._FORMATS[fp8]
    top = torch.finfo(fp8).max
    every = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    every = every[torch.isfinite(every)].sort().values
    mids = (every[1:] + every[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([every, mids, torch.nextafter(mids, every[1:]), torch.nextafter(mids, every[:-1]),
                   torch.randn(4000, generator=g) * torch.logspace(-12, 6, 4000),
                   torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                 top * 1.01, -1e30])]).to(DEVICE)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _fp8_codes[((x.numel() + 1023) // 1024,)](x, out, x.numel(), M=mantissa, BIAS=bias, TOP=top, B=1024)
    want = _bits(reference.fp8_cast(x, torch.tensor(1.0, device=DEVICE), fp8))
    assert torch.equal(out, want), x[out != want][:8].tolist()


def _swiglu_fp8_case(shape, act, seed):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3).to(DEVICE, act)
    gate, up = h.chunk(2, dim=-1)  # row-strided views, as fc1's output gives them
    return gate, up, torch.randn(shape, generator=g).to(DEVICE, act)


@needs_triton
@pytest.mark.parametrize("act, fp8", [(torch.float32, FP8[0]), (torch.bfloat16, FP8[1])])
def test_fp8_codes_and_swiglu_straight_to_fp8_are_the_cast_bit_for_bit(act, fp8):
    """A tensor's FP8 codes and their transpose made in one pass, and SwiGLU's output and input gradient made as
    FP8 codes in the kernel, equal the values (the tensor's; swiglu_triton's) cast by kernels.reference.fp8_cast,
    code for code, row-major and transposed, with the same amax (NaN included), at shapes that are no multiple of
    the 64 x 64 block and from row-strided views; the amax alone (no scale) and the codes alone likewise."""
    fused = _tk("fp8_triton")
    for shape in ((3, 37, 70), (1, 5), (0, 9)):
        gate, up, dy = _swiglu_fp8_case(shape, act, len(shape) + shape[-1])
        if gate.numel() > 40:
            gate[0, 0] = float("nan")
        gg, uu = _leaf(gate), _leaf(up)
        y = _tk("swiglu_triton").swiglu(gg, uu)
        y.backward(dy)
        for kernel, tensors, value in ((fused.fp8_codes, (gate,), gate), (fused.swiglu_fp8, (gate, up), y.detach()),
                                       (fused.swiglu_grad_fp8, (gate, up, dy), torch.cat([gg.grad, uu.grad], -1))):
            v2 = value.reshape(-1, value.shape[-1])
            top = v2.abs().amax().float() if v2.numel() else torch.zeros((), device=DEVICE)
            got = kernel(*tensors, None, fp8, True)
            assert got[:2] == (None, None) and _same(got[2], top), (got[2], top)
            scale = 300.0 / torch.nan_to_num(top, nan=7.0).clamp(min=1.0)  # some codes saturate
            for want_amax in (True, False):
                codes, codes_t, amax = kernel(*tensors, scale, fp8, want_amax)
                want = _bits(reference.fp8_cast(v2, scale, fp8))
                assert torch.equal(_bits(codes), want) and torch.equal(_bits(codes_t), want.t().contiguous())
                assert (amax is None) != want_amax and (not want_amax or _same(amax, top))
            # a step's running amax, max-ed into in place by the launch (blocks' atomic maxima): below, above, NaN
            for start in (0.5, 1e30, float("nan")):
                into = torch.tensor(start, device=DEVICE)
                codes, codes_t, amax = kernel(*tensors, scale, fp8, True, into)
                assert amax is into and _same(into, torch.maximum(torch.tensor(start, device=DEVICE), top)), start
                assert torch.equal(_bits(codes), want) and torch.equal(_bits(codes_t), want.t().contiguous())
            with pytest.raises(ValueError, match="needs want_amax"):
                kernel(*tensors, scale, fp8, False, into)
            into = torch.tensor(0.5)  # the reference's (what the CPU runs) likewise
            assert reference.fp8_codes(v2.cpu(), None, fp8, True, into)[2] is into
            assert _same(into, torch.maximum(torch.tensor(0.5), top.cpu()))
            # current scaling: the scale derived in the kernel from an amax (0, inf, NaN: scale 1; tiny: saturating),
            # its reciprocal written out, both those of kernels.reference.fp8_scale bit for bit
            for a, margin in ((top, 0), (top, 2), (0.0, 0), (float("inf"), 0), (float("nan"), 1), (1e-30, 0),
                              (3e38, 0)):
                a = torch.as_tensor(a, dtype=torch.float32, device=DEVICE)
                derived = reference.fp8_scale(a, torch.finfo(fp8).max, margin)
                ref = getattr(reference, kernel.__name__)
                flat = [t.reshape(-1, t.shape[-1]) for t in tensors]  # the reference takes [M, N], as the engine's
                # the kernel against the values cast; the reference against itself given the scale (its own SwiGLU
                # values may carry a NaN's sign otherwise)
                for impl, args, want in ((kernel, tensors, _bits(reference.fp8_cast(v2, derived, fp8))),
                                         (ref, flat, _bits(ref(*flat, derived, fp8, False)[0]))):
                    inv = torch.full((), -1.0, device=DEVICE)
                    codes, codes_t, _ = impl(*args, reference.FromAmax(a, margin, inv), fp8, False)
                    assert torch.equal(_bits(codes), want) and torch.equal(_bits(codes_t), want.t().contiguous())
                    assert torch.equal(inv, derived.reciprocal()), (impl, a, margin)



@gpu_test
@pytest.mark.parametrize("hardware", [True, False])
def test_gpu_fp8_codes_and_swiglu_straight_to_fp8(hardware):
    """The FP8 code kernels compiled for the card at a 1.3B model's MLP size (4096 tokens, ffn 8192), bf16: the codes
    are the tensor's or swiglu_triton's values under torch's own cast, the amax theirs; by the hardware's
    conversion (what CUDA runs) and by the integer arithmetic (what the CPU tests check)."""
    from unittest import mock
    fused = _tk("fp8_triton")
    gate, up, dy = _swiglu_fp8_case((4096, 8192), torch.bfloat16, 7)
    gg, uu = _leaf(gate), _leaf(up)
    y = dispatch.swiglu(gg, uu)
    y.backward(dy)
    scale = torch.tensor(40.0, device="cuda")
    cases = ((fused.fp8_codes, (dy,), dy), (fused.swiglu_fp8, (gate, up), y.detach()),
             (fused.swiglu_grad_fp8, (gate, up, dy), torch.cat([gg.grad, uu.grad], dim=-1)))
    with mock.patch.object(fused, "HARDWARE_CONVERSION_ON_CUDA", hardware):
        for (kernel, tensors, value), fp8 in ((c, f) for c in cases for f in FP8):
            codes, codes_t, top = kernel(*tensors, scale, fp8, True)
            want = _bits(reference.fp8_cast(value, scale, fp8))
            assert torch.equal(_bits(codes), want) and torch.equal(_bits(codes_t), want.t().contiguous())
            assert torch.equal(top, value.abs().amax().float())
            into = torch.tensor(0.25, device="cuda")  # the running amax, by 8,192 blocks' atomic maxima on the card
            kernel(*tensors, scale, fp8, True, into)
            assert torch.equal(into, top)
            # current scaling's scale derived on the card (div_rn) as torch derives it, and its reciprocal
            for margin in (0, 1):
                derived, inv = reference.fp8_scale(top, torch.finfo(fp8).max, margin), torch.empty((), device="cuda")
                codes, _, _ = kernel(*tensors, reference.FromAmax(top, margin, inv), fp8, False)
                assert torch.equal(_bits(codes), _bits(reference.fp8_cast(value, derived, fp8)))
                assert torch.equal(inv, derived.reciprocal())

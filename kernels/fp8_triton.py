"""Kernels whose outputs are FP8 codes, in Triton: a tensor's codes and their transpose in one pass, and SwiGLU's
output or input gradient straight to codes.

A linear's input or output gradient is quantized for two GEMMs, once as it is and once transposed (the weight
gradient contracts over the tokens). `fp8_codes` reads the tensor once and writes both with each block's largest
magnitude: 4 bytes an element moved for a bf16 tensor under delayed scaling (the scale known before), where an
amax pass, a cast and a transpose one after the other move 7; current scaling needs the whole tensor's amax (over
its tensor-parallel group) before the cast, a pass of its own (6).

Under FP8 training SwiGLU's output is only ever fc2's GEMM operand, and its input gradient only fc1's, so neither
needs to exist in bf16: `swiglu_fp8` and `swiglu_grad_fp8` read gate and up (and the output gradient), compute the
values in fp32, round them to the activations' dtype as `kernels.reference` does, and write their codes and the
transposed codes likewise. Under delayed scaling that is one pass: 6 bytes an output element moved against 13 for
SwiGLU, amax, cast and transpose one after the other; current scaling runs the kernel first for the amax alone.

Each is one launch besides: under delayed scaling the kernel maxes its amax into the step's running amax in place
(`into`: an integer atomic maximum on the bits), and under current scaling it derives the encode scale from the
amax itself (a kernels.reference.FromAmax) and writes its reciprocal for the GEMM. Apart, those were four and about
ten small operations a tensor, which left the H200's FP8 step of 2026-11-27 waiting on the host.

Triton's interpreter (the CPU test of every kernel here) converts fp32 to FP8 wrongly, even normal values
(Triton 3.6), so off a GPU the codes are computed with integer arithmetic, `_fp8_bits`: to nearest, ties to even,
saturated to the format's largest value, NaN kept, which is torch's conversion after the clamp of
`kernels.reference.fp8_cast` (tests/test_kernels_fp8.py: every code, every midpoint, random values). On CUDA the
hardware converts (HARDWARE_CONVERSION_ON_CUDA); the GPU test checks both ways against torch's on the card.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FromAmax, check_into, encode_scale

BLOCK_ROWS, BLOCK_COLS = 64, 64
# Warps per program; the block shape and this are what benchmarks/gpu/tuning.py sweeps. ptxas's report for sm_90
# (tests/test_kernels_compile.py): at 4 warps every codes kernel used all 255 registers a thread (two programs, 8
# warps, a multiprocessor) and SwiGLU's backward spilled 156 bytes; at 8, 128-204 registers and no spills. Not yet
# timed on a GPU (the H200 of 2026-11-27 ran 4: 1.6-2.7 TB/s).
WARPS = 8

# (mantissa bits, exponent bias) of the two formats; the largest value is torch.finfo's
_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
# On CUDA the codes come from the hardware's conversion (Hopper's cvt.rn.satfinite), cheaper than the integer
# arithmetic, which the interpreter runs, and checked against torch's on a card by tests/test_kernels_fp8.py::
# test_gpu_fp8_codes_and_swiglu_straight_to_fp8; False: the integer arithmetic on CUDA too (that test checks both)
HARDWARE_CONVERSION_ON_CUDA = True


@triton.jit
def _fp8_bits(v, M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr):
    """fp32 v -> the FP8 code (its bits, uint8) of clamp(v, -TOP, TOP) rounded to nearest, ties to even."""
    EMIN: tl.constexpr = 1 - BIAS
    nan = v != v  # before the clamp: the language's minimum and maximum may drop a NaN
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    c = tl.where(nan, 0.0, tl.minimum(tl.maximum(v, -TOP), TOP))
    bits = c.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)  # the exponent, subnormals at the smallest normal one's
    # the code's spacing there, ulp, a power of two, and 1 / ulp, both exact (no division: the GPU's is approximate)
    ulp = ((e - M + 127) << 23).to(tl.float32, bitcast=True)
    per_ulp = ((127 - e + M) << 23).to(tl.float32, bitcast=True)
    # |c| / ulp < 2^(M + 1): adding 1.5 * 2^23 rounds it to an integer, to nearest, ties to even
    r = ((tl.abs(c) * per_ulp + 12582912.0) - 12582912.0) * ulp
    normal = (r.to(tl.int32, bitcast=True) >> (23 - M)) - ((127 - BIAS) << M)
    sub = (r * (2.0 ** (M - EMIN))).to(tl.int32)
    mag = tl.where(nan, 0x7F, tl.where(r < 2.0 ** EMIN, sub, normal))
    return (mag | sign).to(tl.uint8)


@triton.jit
def _amax(y):
    """max |y| over the block, NaN if it holds one (as torch's amax; the language's max skips NaNs)."""
    top = tl.max(tl.max(tl.abs(y), 1), 0)
    nans = tl.sum(tl.sum((y != y).to(tl.int32), 1), 0)
    return tl.where(nans > 0, float("nan"), top)


@triton.jit
def _peak(PEAKS, top, INTO: tl.constexpr):
    """This block's amax `top`: stored in its own slot of PEAKS [programs], or with INTO max-ed into PEAKS [1] in
    place, as int32 bits. An amax is +0, positive, +inf or the canonical NaN (_amax), whose bits as integers order
    as their values with the NaN above all (0x7FC00000 > 0x7F800000): the integer maximum is torch.maximum's, NaN
    kept, and it is exact, so the blocks' order does not matter."""
    if INTO:
        tl.atomic_max(PEAKS, top.to(tl.int32, bitcast=True))
    else:
        tl.store(PEAKS + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), top)


@triton.jit
def _encode_scale(SCALE, INV, FROM_AMAX: tl.constexpr, TOP: tl.constexpr, SHRINK: tl.constexpr):
    """The encode scale: the one SCALE points to, or with FROM_AMAX the one derived from the amax SCALE points to,
    as kernels.reference.fp8_scale derives it (TOP the format's largest value, SHRINK 2^margin), its reciprocal
    written to INV by the first program. Correctly rounded divisions (div_rn): the GPU's `/` is approximate
    (div.full.f32), torch's reciprocal is not."""
    a = tl.load(SCALE)
    if FROM_AMAX:
        ok = (a > 0) & (a < float("inf"))  # a NaN fails both
        s = tl.math.div_rn(tl.where(ok, tl.math.div_rn(1.0, tl.where(ok, a, 1.0)) * TOP, 1.0), SHRINK)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(INV, tl.math.div_rn(1.0, s))
        return s
    return a


@triton.jit
def _store_codes(OUT8, OUT8_T, scale, y, rows, cols, mask, n_rows, n_cols, col0,
                 M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, HW: tl.constexpr):
    """y's FP8 codes (as uint8) under encode `scale` at OUT8[rows, col0 + cols] ([n_rows, n_cols]) and
    OUT8_T[col0 + cols, rows] ([n_cols, n_rows]), by the hardware's conversion (HW) or by _fp8_bits."""
    v = y * scale
    if HW:  # saturated first: the conversion is to nearest, ties to even (NaN stays NaN)
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -TOP), TOP))
        if M == 3:
            q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            q = v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        q = _fp8_bits(v, M, BIAS, TOP)
    tl.store(OUT8 + rows[:, None] * n_cols + (col0 + cols)[None, :], q, mask=mask)
    tl.store(OUT8_T + (col0 + cols).to(tl.int64)[None, :] * n_rows + rows[:, None], q, mask=mask)


@triton.jit
def _block(n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """This program's block of a [n_rows, n_cols] grid: its rows (int64), columns and which of them exist."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    return rows, cols, (rows[:, None] < n_rows) & (cols[None, :] < n_cols)


@triton.jit
def _load(P, stride, rows, cols, mask):
    return tl.load(P + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _codes_fwd(X, OUT8, OUT8_T, SCALE, INV, PEAKS, stride_x, n_rows, n_cols,
               M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, HW: tl.constexpr,
               CODES: tl.constexpr, AMAX: tl.constexpr, INTO: tl.constexpr, FROM_AMAX: tl.constexpr,
               SHRINK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    rows, cols, mask = _block(n_rows, n_cols, BR, BC)
    x = _load(X, stride_x, rows, cols, mask)
    if AMAX:
        _peak(PEAKS, _amax(x), INTO)
    if CODES:
        scale = _encode_scale(SCALE, INV, FROM_AMAX, TOP, SHRINK)
        _store_codes(OUT8, OUT8_T, scale, x, rows, cols, mask, n_rows, n_cols, 0, M, BIAS, TOP, HW)


@triton.jit
def _swiglu_fp8_fwd(G, U, OUT8, OUT8_T, SCALE, INV, PEAKS, stride_g, stride_u, n_rows, n_cols,
                    M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, HW: tl.constexpr,
                    CODES: tl.constexpr, AMAX: tl.constexpr, INTO: tl.constexpr, FROM_AMAX: tl.constexpr,
                    SHRINK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    rows, cols, mask = _block(n_rows, n_cols, BR, BC)
    g, u = _load(G, stride_g, rows, cols, mask), _load(U, stride_u, rows, cols, mask)
    y = (g * tl.sigmoid(g) * u).to(G.dtype.element_ty).to(tl.float32)  # swiglu_triton's value, rounded as it
    if AMAX:
        _peak(PEAKS, _amax(y), INTO)
    if CODES:
        scale = _encode_scale(SCALE, INV, FROM_AMAX, TOP, SHRINK)
        _store_codes(OUT8, OUT8_T, scale, y, rows, cols, mask, n_rows, n_cols, 0, M, BIAS, TOP, HW)


@triton.jit
def _swiglu_fp8_bwd(G, U, DY, OUT8, OUT8_T, SCALE, INV, PEAKS, stride_g, stride_u, stride_dy, n_rows, n_cols,
                    M: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, HW: tl.constexpr,
                    CODES: tl.constexpr, AMAX: tl.constexpr, INTO: tl.constexpr, FROM_AMAX: tl.constexpr,
                    SHRINK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    rows, cols, mask = _block(n_rows, n_cols, BR, BC)
    g, u = _load(G, stride_g, rows, cols, mask), _load(U, stride_u, rows, cols, mask)
    dy = _load(DY, stride_dy, rows, cols, mask)
    sig = tl.sigmoid(g)
    silu = g * sig
    # swiglu_triton's backward, rounded as it
    dg = (dy * u * sig * (1.0 + g * (1.0 - sig))).to(G.dtype.element_ty).to(tl.float32)
    du = (dy * silu).to(U.dtype.element_ty).to(tl.float32)
    if AMAX:
        _peak(PEAKS, tl.maximum(_amax(dg), _amax(du), propagate_nan=tl.PropagateNan.ALL), INTO)
    if CODES:
        scale = _encode_scale(SCALE, INV, FROM_AMAX, TOP, SHRINK)
        _store_codes(OUT8, OUT8_T, scale, dg, rows, cols, mask, n_rows, 2 * n_cols, 0, M, BIAS, TOP, HW)
        _store_codes(OUT8, OUT8_T, scale, du, rows, cols, mask, n_rows, 2 * n_cols, n_cols, M, BIAS, TOP, HW)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(kernel, tensors, width, scale, dtype, want_amax, into=None):
    """(codes [rows, width] or None, their transpose, the amax or None) from `kernel` over `tensors` [rows, F];
    `scale` a 0-d tensor, None (the amax alone) or a FromAmax (the kernel derives the scale and writes its
    reciprocal); with `into` (a 0-d fp32 tensor) the amax is max-ed into it in place and `into` is the amax
    returned."""
    check_into(into, want_amax)
    n, f = tensors[0].shape
    grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(f, BLOCK_COLS))
    dev = tensors[0].device
    if into is not None:
        peaks = into.view(torch.int32).reshape(1)
    elif want_amax and n and f:
        peaks = torch.empty(grid[0] * grid[1], device=dev)  # every program writes its own
    else:
        peaks = torch.zeros(1, device=dev)  # no rows: amax 0
    codes = None if scale is None else torch.empty((n, width), dtype=torch.uint8, device=dev)
    codes_t = None if scale is None else torch.empty((width, n), dtype=torch.uint8, device=dev)
    derive = isinstance(scale, FromAmax)
    if derive and not (n and f):  # no launch to derive it in
        encode_scale(scale, dtype)
    mantissa, bias = _FORMATS[dtype]
    if n and f:
        dummy = peaks  # an unused pointer where no codes are written
        given = None if scale is None else (scale.amax if derive else scale).float().reshape(1)
        kernel[grid](*tensors, dummy if codes is None else codes, dummy if codes_t is None else codes_t,
                     dummy if given is None else given, scale.inv.reshape(1) if derive else dummy, peaks,
                     *(t.stride(0) for t in tensors), n, f, M=mantissa, BIAS=bias, TOP=torch.finfo(dtype).max,
                     HW=HARDWARE_CONVERSION_ON_CUDA and dev.type == "cuda", CODES=scale is not None,
                     AMAX=want_amax, INTO=into is not None, FROM_AMAX=derive,
                     SHRINK=2.0 ** scale.margin if derive else 1.0, BR=BLOCK_ROWS, BC=BLOCK_COLS, num_warps=WARPS)
    top = into if into is not None else peaks.amax() if want_amax else None
    if codes is None:
        return None, None, top
    return codes.view(dtype), codes_t.view(dtype), top


def fp8_codes(x, scale, dtype, want_amax, into=None):
    """kernels.reference.fp8_codes of x [M, K] (any row stride), in one pass."""
    x2 = _rows(x)
    return _launch(_codes_fwd, (x2,), x2.shape[1], scale, dtype, want_amax, into)


def swiglu_fp8(gate, up, scale, dtype, want_amax, into=None):
    """kernels.reference.swiglu_fp8, in one pass over gate and up (two with `scale` None and then given)."""
    g2, u2 = _rows(gate), _rows(up)
    return _launch(_swiglu_fp8_fwd, (g2, u2), g2.shape[1], scale, dtype, want_amax, into)


def swiglu_grad_fp8(gate, up, dy, scale, dtype, want_amax, into=None):
    """kernels.reference.swiglu_grad_fp8, in one pass over gate, up and dy."""
    g2, u2, dy2 = _rows(gate), _rows(up), _rows(dy)
    return _launch(_swiglu_fp8_bwd, (g2, u2, dy2), 2 * g2.shape[1], scale, dtype, want_amax, into)

"""Every Triton kernel, at the launch configuration a GPU run uses, compiles for Hopper (sm_90) and fits
its shared memory; no GPU needed (triton ships ptxas). This is the only check of the compiled path on a
machine without one: the interpreter skips code generation, layouts and shared-memory planning.

The compilation runs in a fresh process: @triton.jit reads TRITON_INTERPRET at import, and a process
that has run the interpreter (tests/test_kernels.py does on CPU) cannot compile afterwards.
"""
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # the ahead-of-time API moved
    pytestmark = pytest.mark.skip(reason="this triton has no ASTSource/GPUTarget ahead-of-time API")

HOPPER_SHARED_BYTES = 232448  # 227 KiB of opt-in dynamic shared memory per block on H100/H200
FP32_POINTERS = {"MEAN", "RSTD", "LSE", "DELTA", "MAX", "SUMEXP", "TLOGIT", "COEF_S", "COEF_O", "DW_PART",
                 "DB_PART", "FREQS", "SCALE", "PEAKS", "INV"}
U8_POINTERS = {"OUT8", "OUT8_T"}  # FP8 codes, written as their bits
SIZES = {"BATCH", "H", "M", "N", "S", "NQ", "NKV", "NH", "HALF", "GROUP", "TOTAL"}  # upper-case scalars


def _signature(fn, dtype, constexprs):
    """Triton types for each argument, from the naming convention of kernels/: upper-case names other
    than sizes are pointers (fp32 for statistics, int64 for targets), batch strides are 64-bit."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "TARGET":
            sig[name] = "*i64"
        elif name in ("VISITS", "DOCS"):  # block counter; documents' first and last positions
            sig[name] = "*i32"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in U8_POINTERS:
            sig[name] = "*u8"
        elif name.isupper() and name not in SIZES:
            sig[name] = "*" + dtype
        elif name in ("sm_scale", "eps", "sign"):
            sig[name] = "fp32"
        elif name.startswith("s") and name.endswith("b") and len(name) <= 5:
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def _compile(fn, dtype, constexprs, warps, stages, types=None):
    """`types`: argument types that differ from the naming convention's ({name: Triton type})."""
    src = ASTSource(fn, {**_signature(fn, dtype, constexprs), **(types or {})}, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert kernel.asm["cubin"], f"{fn.__name__}: no cubin"
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, f"{fn.__name__}: {kernel.metadata.shared} bytes shared"
    return kernel


@pytest.mark.slow  # about a minute on 2 cores: ptxas runs once per kernel variant
def test_kernels_compile_for_sm90():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _spill_stores(kernel) -> int:
    """Bytes a thread spills to local memory (ptxas -v on the kernel's PTX for sm_90, with the ptxas Triton itself
    takes for sm_90: Triton 3.9 ships two, and its PTX is newer than the one named plain `ptxas`)."""
    import re
    import tempfile
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):  # a Triton without the resolver: the one it ships
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.o")], capture_output=True,
                              text=True, timeout=120)
    found = re.findall(r"(\d+) bytes spill stores", done.stdout + done.stderr)
    assert done.returncode == 0 and found, done.stdout[-2000:] + done.stderr[-2000:]
    return max(int(n) for n in found)


def check_default_launches_do_not_spill():
    """The launches the kernels run at by default keep their arrays in registers (METHOD: spills are local-memory
    traffic): the norms' backward at hidden 2048, 4096 and 8192, RMSNorm and LayerNorm, the FP8 codes kernels, and
    the attention kernels within 256 bytes (flash_triton._configs says which spill what).
    One exception, measured: RMSNorm's backward at 8192 spills 156 bytes at 2 rows an iteration (252 with the fused
    residual's gradient), the fastest setting the H200 sweep found (3.45 TB/s against 3.01 at 1 row, which spills
    none; the residual variant is swept next). At the earlier launch (4 warps) LayerNorm's backward spilled 2,000
    bytes a thread and ran at half RMSNorm's rate.
    The allowances are what ptxas gives under Triton 3.6, the GPU machines' (torch 2.11's). Another Triton's
    register allocation differs by a few dozen bytes (3.9's: LayerNorm's backward at 2048 spills 24, the attention's
    dQ kernel at head dim 128 with both masks 264), so there only spills of the size that cost LayerNorm half its
    rate (2,000 bytes) or the dK/dV kernel its speed (1,320) fail: over 512 bytes."""
    from kernels import flash_triton, fp8_triton, norm_triton
    measured = triton.__version__.startswith("3.6.")

    def within(spilled: int, allowed: int) -> bool:
        return spilled <= (allowed if measured else 512)
    for hidden in (2048, 4096, 8192):
        block, warps = norm_triton._launch_config(hidden)
        for rms in (True, False):
            rows = norm_triton._bwd_rows(block, warps, rms)
            for dsum in (False, True):
                spilled = _spill_stores(_compile(norm_triton._norm_bwd, "bf16", dict(
                    IS_RMS=rms, HAS_BIAS=not rms, HAS_DSUM=dsum, BLOCK=block, ROWS=rows), warps, 3))
                allowed = (256 if dsum else 160) if rms and hidden == 8192 else 0
                assert within(spilled, allowed), (hidden, "rms" if rms else "layer", dsum, warps, rows, spilled)
    for d in (64, 128):  # the Triton attention's kernels at their launches, plain causal and with both masks
        configs = flash_triton._configs(d, torch.bfloat16, True)
        for kernel, (bm, bn, warps, stages) in zip((flash_triton._attn_fwd, flash_triton._attn_bwd_dkdv,
                                                    flash_triton._attn_bwd_dq), configs):
            for masks in (False, True):
                spilled = _spill_stores(_compile(kernel, "bf16", dict(
                    CAUSAL=True, WINDOWED=masks, DOCUMENTS=masks, COUNT=False, D=d, BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_D=d, PRECISION="tf32"), warps, stages))
                assert within(spilled, 256), (kernel.__name__, d, masks, spilled)
    for kernel in (fp8_triton._codes_fwd, fp8_triton._swiglu_fp8_fwd, fp8_triton._swiglu_fp8_bwd):
        for delayed in (True, False):  # the amax max-ed into a running one; the scale derived from one
            spilled = _spill_stores(_compile(kernel, "bf16", dict(
                HW=True, CODES=True, AMAX=delayed, INTO=delayed, FROM_AMAX=not delayed, SHRINK=1.0, M=3, BIAS=7,
                TOP=448.0, BR=fp8_triton.BLOCK_ROWS, BC=fp8_triton.BLOCK_COLS), fp8_triton.WARPS, 3,
                {"PEAKS": "*i32"}))
            assert within(spilled, 0), (kernel.__name__, delayed, spilled)


def compile_all():
    from kernels import ce_triton, flash_triton, fp8_triton, norm_triton, rope_triton, swiglu_triton
    dt = "bf16"
    block = dict(BR=fp8_triton.BLOCK_ROWS, BC=fp8_triton.BLOCK_COLS)
    e4m3, e5m2 = dict(M=3, BIAS=7, TOP=448.0), dict(M=2, BIAS=15, TOP=57344.0)
    for kernel in (fp8_triton._codes_fwd, fp8_triton._swiglu_fp8_fwd, fp8_triton._swiglu_fp8_bwd):
        # the hardware's conversion (CUDA's path) in both formats, the integer one, and the amax pass alone
        for fmt, hw, codes in ((e4m3, True, True), (e5m2, True, True), (e4m3, False, True), (e4m3, True, False)):
            ptx = _compile(kernel, dt, dict(HW=hw, CODES=codes, AMAX=True, INTO=False, FROM_AMAX=False, SHRINK=1.0,
                                            **fmt, **block), 4, 3).asm["ptx"]
            # the hardware's conversion: to nearest, ties to even, saturating (torch's after the clamp)
            want = f"cvt.rn.satfinite.{'e4m3' if fmt is e4m3 else 'e5m2'}x2.f32"
            assert (want in ptx) == (hw and codes), (kernel.__name__, want, hw, codes)
        # the amax max-ed into a running one (delayed scaling's step amax): an integer atomic maximum on its bits
        ptx = _compile(kernel, dt, dict(HW=True, CODES=True, AMAX=True, INTO=True, FROM_AMAX=False, SHRINK=1.0,
                                        **e4m3, **block), 4, 3, {"PEAKS": "*i32"}).asm["ptx"]
        assert "atom.global" in ptx and ".max.s32" in ptx, kernel.__name__
        # current scaling: the scale derived from the amax in the kernel, by correctly rounded divisions (SwiGLU's
        # sigmoid divides approximately, as swiglu_triton's, which its values match)
        ptx = _compile(kernel, dt, dict(HW=True, CODES=True, AMAX=False, INTO=False, FROM_AMAX=True, SHRINK=2.0,
                                        **e5m2, **block), 4, 3).asm["ptx"]
        assert "div.rn.f32" in ptx, kernel.__name__
        assert kernel is not fp8_triton._codes_fwd or ("div.full" not in ptx and "div.approx" not in ptx)
    from benchmarks.gpu.tuning import CODES_LAUNCHES
    for rows, cols, warps in CODES_LAUNCHES[1:]:  # the others the GPU sweep times (the first, 4 warps: above)
        _compile(fp8_triton._swiglu_fp8_fwd, dt, dict(HW=True, CODES=True, AMAX=True, INTO=True, FROM_AMAX=False,
                                                       SHRINK=1.0, M=3, BIAS=7, TOP=448.0, BR=rows, BC=cols), warps, 3,
                 {"PEAKS": "*i32"})
    for rms in (True, False):
        flags = dict(IS_RMS=rms, HAS_BIAS=not rms, BLOCK=8192)
        _compile(norm_triton._norm_fwd, dt, dict(HAS_RES=True, **flags), 16, 3)
        _compile(norm_triton._norm_bwd, dt, dict(HAS_DSUM=True, ROWS=norm_triton.BWD_ROWS_PER_ITER, **flags), 16, 3)
    for rows in (2, 4):  # the backward's other rows per loop iteration that benchmarks/gpu/tuning.py times
        _compile(norm_triton._norm_bwd, dt, dict(HAS_DSUM=True, IS_RMS=True, HAS_BIAS=False, BLOCK=8192, ROWS=rows),
                 16, 3)
    for rows in (1, 2, 4):  # rows per program: the default and what benchmarks/gpu/tuning.py times
        _compile(rope_triton._rope_kernel, dt, dict(BLOCK_H=32, BLOCK_D=64, ROWS=rows), 8, 3)
    _compile(swiglu_triton._swiglu_fwd, dt, dict(BLOCK=swiglu_triton.BLOCK), 4, 3)
    _compile(swiglu_triton._swiglu_bwd, dt, dict(BLOCK=swiglu_triton.BLOCK), 4, 3)
    _compile(ce_triton._ce_stats, dt, dict(BLOCK_V=ce_triton.BLOCK_V), 8, 3)
    _compile(ce_triton._ce_grad, dt, dict(BLOCK_V=ce_triton.BLOCK_V), 8, 3)
    for d in (64, 128):
        fwd, dkdv, dq = flash_triton._configs(d, torch.bfloat16, True)
        for kernel, (bm, bn, warps, stages) in ((flash_triton._attn_fwd, fwd), (flash_triton._attn_bwd_dkdv, dkdv),
                                                (flash_triton._attn_bwd_dq, dq)):
            for windowed, documents in ((False, False), (True, False), (False, True), (True, True)):
                # causal; with a sliding window; with packed documents; with both
                _compile(kernel, dt, dict(CAUSAL=True, WINDOWED=windowed, DOCUMENTS=documents, COUNT=False, D=d,
                                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, PRECISION="tf32"), warps, stages)
        _compile(flash_triton._attn_bwd_delta, dt, dict(D=d, BLOCK_M=flash_triton.DELTA_BLOCK, BLOCK_D=d), 4, 3)


if __name__ == "__main__":
    compile_all()
    check_default_launches_do_not_spill()

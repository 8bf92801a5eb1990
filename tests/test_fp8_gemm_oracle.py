"""The FP8 GEMM paths against torch's own `_scaled_mm` on the CPU (the oracle): tile-scaled products per 128-wide
block within fp32 accumulation order, and the experts' row-scaled CUDA path bit for bit. They need a torch whose CPU
`_scaled_mm` takes row-wise scales (2.13 on); under 2.11 they skip, saying so."""
import pytest
import torch
from test_fp8 import SHAPES

from engine.fp8 import gemm
from engine.fp8.experts import Fp8Experts
from engine.fp8.quantize import E4M3, quantize_tiles
from engine.fp8.scaling import Recipe


def _cpu_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales (2.13 and 2.14 do; 2.11's takes one scale a
    tensor only, so the oracle of the two tests that use them does not exist there)."""
    a = torch.zeros((16, 16), dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


needs_cpu_row_scales = pytest.mark.skipif(not _cpu_row_scales(), reason=f"torch {torch.__version__}'s CPU "
                                          "_scaled_mm takes no row-wise scales: the oracle needs torch >= 2.13")


@needs_cpu_row_scales
def test_tile_scaled_gemm_is_scaled_mm_per_block_within_accumulation_order():
    """_scaled_mm takes no 1x128 x 128x128 scales on the CPU: per 128-wide K block it is a row-scaled GEMM
    (a's rows, b's 128-row tiles as rows), and the blocks are summed; only the summation order differs."""
    for t, k, n in SHAPES:
        g = torch.Generator().manual_seed(n)
        a, b = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g)
        qa, qb = quantize_tiles(a, (1, 128), E4M3), quantize_tiles(b, (128, 128), E4M3)
        want = torch.zeros(t, n)
        for j in range(0, k, 128):
            kb = j // 128
            sa = qa.scale_inv[:, kb:kb + 1].contiguous()
            sb = qb.scale_inv[qb.tile_of[0], kb].reshape(1, n).contiguous()
            want += torch._scaled_mm(qa.data[:, j:j + 128].contiguous(), qb.data[:, j:j + 128].contiguous().t(),
                                     scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        got = gemm.mm(qa, qb, torch.float32)
        bound = k * 2.0 ** -23 * (qa.dequantize().abs() @ qb.dequantize().abs().t())
        assert ((got - want).abs() <= bound).all(), (t, k, n, (got - want).abs().max())


@needs_cpu_row_scales
def test_row_scaled_scaled_mm_is_the_experts_dequantized_product_bitwise():
    """engine.fp8.gemm.row_scaled, the experts' CUDA path (FP8 tensor cores with row-wise scales): torch's CPU
    `_scaled_mm` with the experts' operands, per-token x and one-scale weights, forward (x @ w) and input gradient
    (dy @ w^T through a transposed view), equals the dequantized product the CPU runs, bit for bit, in fp32 and bf16;
    scales that vary along K (1x128 tiles over K > 128) are not row-wise, so those stay dequantized."""
    from engine.fp8.experts import _transposed_view
    g = torch.Generator().manual_seed(5)
    for n, k, m in ((32, 64, 48), (37, 200, 130), (256, 128, 384)):
        ex = Fp8Experts(Recipe("e4m3", "tensorwise"))
        xq, dyq = ex.rows(torch.randn(n, k, generator=g) * 3, False), ex.rows(torch.randn(n, m, generator=g), True)
        wq = ex.weight(torch.randn(k, m, generator=g) * 0.1)
        for a, b in ((xq, wq), (dyq, _transposed_view(wq))):
            want = gemm.operand(a, torch.float32).matmul(gemm.operand(b, torch.float32))
            for dtype in (torch.float32, torch.bfloat16):
                assert torch.equal(gemm.row_scaled(a, b, dtype), want.to(dtype)), (n, k, m, dtype)
    tiled = Fp8Experts(Recipe("e4m3", "blockwise"))
    assert gemm.row_scaled(tiled.rows(torch.randn(8, 256), False), tiled.weight(torch.randn(256, 16)),
                           torch.float32) is None

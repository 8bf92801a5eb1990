"""engine.planner.flops: the FLOPs count against the papers' closed forms and their published MFU figures."""
import pytest

from engine.config import ModelConfig
from engine.planner.flops import GPU_PRESETS, detect_gpu, flops_per_iteration, mfu, tflops_per_gpu


def gpt(layers, hidden, heads, vocab=51200, seq=2048, **kw):
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                       seq_length=seq, **kw)


@pytest.mark.parametrize("layers,hidden,heads,batch", [(24, 2304, 24, 512), (96, 12288, 96, 1536), (128, 25600, 160, 3072)])
def test_matches_narayanan_and_korthikanti_closed_forms(layers, hidden, heads, batch):
    m, s, V = gpt(layers, hidden, heads), 2048, 51200  # 51200 is already a multiple of 128
    l, h, B = layers, hidden, batch
    model = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))      # Korthikanti 2022, sec. 6
    full = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))       # Narayanan 2021, eq. 3
    assert flops_per_iteration(m, B, s) == pytest.approx(model, rel=1e-12)
    assert flops_per_iteration(m, B, s, "full") == pytest.approx(full, rel=1e-12)
    selective = model + B * l * 4 * s * s * h  # the attention core's forward once more
    assert flops_per_iteration(m, B, s, "selective") == pytest.approx(selective, rel=1e-12)


# Korthikanti et al. 2022, Table 5 ("present work" rows: sequence parallelism + selective recomputation),
# A100 312 TFLOP/s, seq 2048, vocab 51200: (layers, hidden, heads, GPUs, batch, iteration s, reported MFU %).
KORTHIKANTI_TABLE = [(48, 6144, 64, 8, 4, 1.10, 41.5), (96, 12288, 96, 64, 64, 13.75, 51.4),
                     (105, 20480, 128, 280, 280, 37.83, 56.0), (128, 25600, 160, 512, 512, 71.49, 56.3)]


@pytest.mark.parametrize("layers,hidden,heads,gpus,batch,seconds,reported", KORTHIKANTI_TABLE)
def test_published_mfu_reproduced_with_full_attention_convention(layers, hidden, heads, gpus, batch, seconds, reported):
    """The published iteration times give the published MFU only when attention counts the full s²."""
    flops = flops_per_iteration(gpt(layers, hidden, heads), batch, 2048)
    assert 100 * mfu(flops, seconds, gpus, 312.0) == pytest.approx(reported, abs=0.25)


def test_gqa_swiglu_untied_count():
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                    swiglu=True, vocab_size=100, seq_length=8, make_vocab_size_divisible_by=8)
    h, d, s = 64, 16, 8
    per_layer_params = h * (4 + 2 * 2) * d + 4 * d * h + 2 * 96 * h + 96 * h
    fwd = 2 * (2 * s * per_layer_params + 4 * s * s * 4 * d) + 2 * s * h * 104
    assert m.padded_vocab_size() == 104
    assert flops_per_iteration(m, 3, s) == 3 * 3 * fwd


def test_mfu_and_tflops():
    assert tflops_per_gpu(8e15, 2.0, 4) == pytest.approx(1000.0)
    assert mfu(8e15, 2.0, 4, 989.0) == pytest.approx(1000.0 / 989.0)


def test_presets_and_device_names():
    assert set(GPU_PRESETS) == {"a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "b200"}
    assert GPU_PRESETS["a100-80g"].peak_tflops == 312.0 and GPU_PRESETS["h100-sxm"].peak_tflops == 989.0
    for spec in GPU_PRESETS.values():
        assert min(spec.peak_tflops, spec.memory_gib, spec.hbm_tbps, spec.nvlink_gbps, spec.network_gbps) > 0
    assert detect_gpu("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert detect_gpu("NVIDIA H100 PCIe").name == "h100-pcie"
    assert detect_gpu("NVIDIA A100-SXM4-40GB").name == "a100-40g"
    assert detect_gpu("NVIDIA A100-SXM4-80GB").name == "a100-80g"
    assert detect_gpu("NVIDIA H200").name == "h200"
    assert detect_gpu("Some CPU") is None

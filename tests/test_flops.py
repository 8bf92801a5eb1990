"""engine.flops: the FLOPs count against the papers' closed forms and their published MFU figures."""
import dataclasses

import pytest

from engine.config import ModelConfig
from engine.flops import (
    GPU_PRESETS,
    activated_params,
    detect_gpu,
    flops_per_iteration,
    forward_flops_per_sequence,
    layer_matmul_params,
    mfu,
    tflops_per_gpu,
)


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


# --- mixture of experts: FLOPs count the activated parameters -----------------------------------

def _config(name):
    import os

    from engine.cli import parse_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return parse_config(["--config", os.path.join(root, "configs", name)]).model


def _per_token_matmul_flops(m):
    f = forward_flops_per_sequence(m, 1)
    return f["linear"] + f["logits"]


def test_mixtral_8x7b_flops_count_12_9b_activated_of_46_7b_parameters():
    """Jiang et al. 2024 (arXiv:2401.04088): 46.7B parameters, 12.9B used per token (top 2 of 8 experts)."""
    from engine.layout import Layout
    from engine.planner.params import params_per_rank
    m = _config("mixtral-8x7b.yaml")
    assert sum(params_per_rank(m, Layout())) == pytest.approx(46.7e9, rel=0.005)
    assert activated_params(m) == pytest.approx(12.9e9, rel=0.005)
    # A forward pass multiplies by every activated weight but the input embedding's (a lookup) once per token.
    assert _per_token_matmul_flops(m) == pytest.approx(2 * (12.9e9 - 32000 * 4096), rel=0.01)
    assert _per_token_matmul_flops(m) == pytest.approx(2 * 12.9e9, rel=0.02)
    # Per MoE layer: attention + 2 experts of 3·h·F + the router's h·E, nothing of the 6 idle experts.
    h, F = 4096, 14336
    assert layer_matmul_params(m, moe=True) == 2 * h * 4096 + 2 * h * 1024 + 2 * 3 * h * F + h * 8
    s, B = 4096, 256
    f = forward_flops_per_sequence(m, s)
    assert flops_per_iteration(m, B, s) == 3 * B * (f["linear"] + f["attention"] + f["logits"])


def test_deepseek_v3_totals_are_the_published_671b_and_37b_activated():
    """DeepSeek-V3 (arXiv:2412.19437): 671B parameters, 37B activated per token, its MTP module (which the report
    counts apart: 14B) left out; with it, what the last stage also holds. MLA per layer: q down 7168x1536, q up
    1536x128x192, kv down 7168x(512+64), kv up 512x128x256, output 128x128x7168, two latent norms."""
    from engine.layout import Layout
    from engine.planner.params import params_per_rank
    m = _config("deepseek-v3.yaml")
    assert m.moe_layers() == list(range(3, 61)) and m.routed_layers() == list(range(3, 62))
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert layer_matmul_params(m) - layer_matmul_params(m, moe=False) == 0
    assert layer_matmul_params(m) == mla + 3 * 7168 * 18432
    with_mtp = sum(params_per_rank(m, Layout()))
    m.mtp_num_layers = None
    assert sum(params_per_rank(m, Layout())) == pytest.approx(671e9, rel=0.01)
    # The published "37B" (two significant digits) lies between the counts without the input embedding (a
    # lookup: 35.70B of layers + the output head's 0.93B = 36.63B, which rounds to it) and with it (37.55B). A 1%
    # band around 37.0B holds neither (-1.01%, +1.49%): the figure is rounded, not a count to 1%.
    without, with_lookup = activated_params(m, embedding=False), activated_params(m)
    assert with_lookup - without == 129280 * 7168
    assert without < 37e9 < with_lookup and round(without / 1e9) == 37
    # DeepSeek-V2 (arXiv:2405.04434: 236B, 21B activated) on the same side: 60 layers of 5120, 160 routed experts
    # of 1536 (top 6) and 2 shared, the first layer dense (12288), 102400-token vocabulary.
    v2 = dataclasses.replace(m, num_layers=60, hidden_size=5120, ffn_hidden_size=12288, moe_ffn_hidden_size=1536,
                             moe_shared_expert_intermediate_size=2 * 1536, num_experts=160, moe_router_topk=6,
                             moe_layer_freq="[0]*1+[1]*59", vocab_size=102400, moe_router_group_topk=3)
    assert sum(params_per_rank(v2, Layout())) == pytest.approx(236e9, rel=0.005)
    assert activated_params(v2, embedding=False) < 21e9 < activated_params(v2)
    assert round(activated_params(v2, embedding=False) / 1e9) == 21
    # the MTP module: its norms, the 2h -> h projection and an MoE layer with all 256 experts (the report's 14B
    # also counts the embedding and output head its checkpoint stores again)
    moe_layer = mla + 1536 + 512 + 2 * 7168 + 257 * 3 * 7168 * 2048 + 7168 * 256 + 256
    assert with_mtp - sum(params_per_rank(m, Layout())) == 3 * 7168 + 2 * 7168 ** 2 + moe_layer
    # 8 routed + 1 shared expert of 3·h·2048 and the 256-way router per MoE layer; 3 dense layers of 18432.
    expert = 3 * 7168 * 2048
    assert layer_matmul_params(m, moe=True) - layer_matmul_params(m) == 9 * expert + 7168 * 256 - 3 * 7168 * 18432


def test_moe_flops_per_token_match_the_engines_experts_and_gelu_counts_two_matrices():
    """The planner's MoE count equals what the engine's MoE block multiplies by: k x Experts.flops_per_token()
    plus its shared MLP and router (built on the meta device), for SwiGLU and GELU experts."""
    from engine.model import GPTModel
    from engine.parallel.topology import ParallelContext
    for swiglu in (True, False):
        m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, swiglu=swiglu,
                        vocab_size=128, seq_length=8, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
                        moe_shared_expert_intermediate_size=32, moe_layer_freq="[0,1]", disable_bias_linear=True)
        model = GPTModel(m, ParallelContext.virtual(), device="meta")
        mlp = model.layers["1"].mlp
        shared = sum(p.numel() for p in mlp.shared.parameters())
        engine = 2 * mlp.experts.flops_per_token() + 2 * shared + 2 * mlp.router.weight.numel()
        assert 2 * (layer_matmul_params(m, moe=True) - layer_matmul_params(m) + (3 if swiglu else 2) * 64 * 96) \
            == engine
        assert mlp.experts.flops_per_token() == (3 if swiglu else 2) * 2 * 64 * 48
    # A dense model (no biases, no learned positions) uses every parameter.
    dense = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=8,
                        disable_bias_linear=True, position_embedding_type="rope")
    built = GPTModel(dense, ParallelContext.virtual(), device="meta")
    assert activated_params(dense) == sum(p.numel() for p in built.parameters())

"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM (engine/latent_attention.py, engine/rope.py, the router's
group-limited selection, engine/checkpoint/hf/deepseek_v3.py).

A tiny DeepSeek-V3 made by transformers (MLA with and without a q latent, YaRN RoPE with mscale, sigmoid routing
with a non-zero expert bias, 2 of 4 expert groups, a routed scaling factor, the first layer dense, a shared
expert; weights spread so that routing is far from ties) is imported with tools/convert_hf.py: one rank's logits
equal transformers' within 1e-5. Exported back with tools/merge_ckpt.py --format hf, every tensor equals the
original. A model no HF family computes is refused in one line. Budget: a few seconds.
"""
import copy
import os

import pytest
import torch

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.cli import parse_config
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks

VOCAB, SEQ = 100, 16
transformers = pytest.importorskip("transformers")


def hf_config(**changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                  v_head_dim=10, qk_nope_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=3,
                  first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
    return transformers.DeepseekV3Config(**(fields | changes))


def hf_model(tmp_path, **changes):
    """A transformers DeepSeek-V3 with spread weights, saved under tmp_path/hf."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config(**changes)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "gate.weight" in name else 0.08))
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=gen))
    hf.save_pretrained(str(tmp_path / "hf"))
    return hf


def imported(tmp_path):
    from convert_hf import main
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--seq-length", str(SEQ)]) == 0
    cfg = parse_config(["--config", os.path.join(tmp_path / "ckpt", "model.yaml"), "--mock-data"])
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(str(tmp_path / "ckpt"), [model], None, ctx, model_cfg=cfg.model)
    return cfg, model.eval()


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-latent", "q-projection"])
def test_import_has_transformers_logits_and_export_round_trips(tmp_path, q_lora_rank):
    hf = hf_model(tmp_path, q_lora_rank=q_lora_rank)
    cfg, model = imported(tmp_path)
    m = cfg.model
    assert m.multi_latent_attention and m.q_lora_rank == q_lora_rank and m.moe_layer_freq == "[0]*1+[1]*2"
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (m.rotary_scaling_factor, m.mscale_all_dim, m.moe_shared_expert_intermediate_size) == (4.0, 1.0, 16)
    assert m.moe_router_enable_expert_bias and m.moe_router_score_function == "sigmoid"
    with torch.no_grad():
        ours = model(tokens=tokens())[..., :VOCAB]
        theirs = hf(tokens()).logits.float()
        chosen = hf.model.layers[1].mlp.gate(torch.randn(64, 32, generator=torch.Generator().manual_seed(3)))[2]
    assert len(chosen.unique()) == 8, "every expert is used by some token: all of them are compared"
    assert ours.std() > 0.1
    assert (ours - theirs).abs().max().item() < 1e-5

    save_checkpoint(str(tmp_path / "save"), 1, [model], None, ParallelContext.virtual(), cfg, {})
    from merge_ckpt import main
    assert main(["--load", str(tmp_path / "save"), "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = hf.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, original[name]), name


@pytest.fixture(scope="module")
def default_import(tmp_path_factory):
    """(transformers' model, the run config and model imported from it) of the default tiny DeepSeek-V3."""
    tmp_path = tmp_path_factory.mktemp("deepseek")
    hf = hf_model(tmp_path)
    return (hf,) + imported(tmp_path)


def test_group_limited_routing_is_transformers(default_import):
    """The router alone on the same inputs: the same experts and weights as DeepseekV3TopkRouter."""
    hf, _, model = default_import
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(4))
    _, weights, experts = hf.model.layers[2].mlp.gate(x)
    keys = torch.zeros(256, 2, dtype=torch.long)
    routing = model.layers["2"].mlp.router(x, keys, (256, 1))
    order, hf_order = routing.experts.sort(-1), experts.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.allclose(routing.weights.gather(1, order.indices), weights.gather(1, hf_order.indices), atol=1e-6)
    groups = routing.experts // 2
    assert all(len(set(row.tolist())) <= 2 for row in groups), "each token's experts lie in at most 2 groups"


@pytest.mark.parametrize("change,why", [
    ({"norm_epsilon": 1e-5}, "--norm-epsilon 1e-05: transformers' latent norms use 1e-06"),
    ({"moe_router_score_function": "softmax"}, "the router scores with softmax"),
    ({"mtp_num_layers": 1}, "transformers' DeepseekV3ForCausalLM has no multi-token prediction module"),
], ids=["eps", "softmax", "mtp"])
def test_what_deepseek_v3_does_not_compute_is_refused_in_one_line(tmp_path, capsys, default_import, change, why):
    cfg = copy.deepcopy(default_import[1])
    for name, value in change.items():
        setattr(cfg.model, name, value)
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx)[0]
    save_checkpoint(str(tmp_path / "save"), 1, [model], None, ctx, cfg, {})
    capsys.readouterr()  # transformers' progress bars
    from merge_ckpt import main
    assert main(["--load", str(tmp_path / "save"), "--out", str(tmp_path / "out"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"merge_ckpt.py: error: --format hf: {why}") and err.count("\n") == 1, err


def test_deepseeks_own_mtp_tensors_are_left_out_with_a_note(tmp_path, capsys):
    """DeepSeek's release keeps its MTP module as layer num_hidden_layers; the import notes and leaves it out."""
    from safetensors.torch import load_file, save_file
    hf_model(tmp_path)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors |= {"model.layers.3.enorm.weight": torch.ones(32), "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    capsys.readouterr()
    from convert_hf import main
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--seq-length", str(SEQ)]) == 0
    assert "note: left out the tensors model.layers.3.*: DeepSeek's own multi-token prediction" in capsys.readouterr().out

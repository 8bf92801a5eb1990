"""MoE models to and from Hugging Face `transformers` (engine/checkpoint/hf/mixtral.py, qwen2_moe.py).

A tiny engine MoE model (one rank, fp32, weights nudged away from their init) is saved as a checkpoint,
exported with tools/merge_ckpt.py --format hf and loaded with AutoModelForCausalLM: Mixtral-shaped models
load as MixtralForCausalLM, ones with a shared expert (dense layers allowed) as Qwen2MoeForCausalLM, with
no missing or unexpected tensors and logits equal to the engine's within 1e-4 (dropless routing). The
Mixtral export converts back (tools/convert_hf.py) to identical tensors. Shapes neither family computes
exactly are refused in one line with exit status 2. Budget: a few seconds.
"""
import json
import os

import pytest
import torch

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.hf import MOE_ARCHITECTURES, hf_config, model_fields
from engine.cli import parse_config
from engine.config import Config
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks

VOCAB, SEQ = 100, 16


def _merge_main(argv):
    import importlib
    return importlib.import_module("tools.merge_ckpt").main(argv)


def moe_config(**changes) -> Config:
    """2 layers, hidden 32, 4 heads in 2 query groups, 4 experts of width 24, top-2: Mixtral-shaped."""
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.seq_length = 2, 32, 4, 2, SEQ
    m.vocab_size, m.make_vocab_size_divisible_by, m.ffn_hidden_size = VOCAB, 16, 48
    m.normalization, m.position_embedding_type, m.swiglu = "RMSNorm", "rope", True
    m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, True
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 24
    for name, value in changes.items():
        setattr(m, name, value)
    return cfg


def saved_model(tmp_path, cfg):
    """The model of `cfg` on one rank with nudged weights, saved under tmp_path/save; (model, ctx)."""
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx, vocab_size=VOCAB)[0]
    with torch.no_grad():
        for p in model.parameters():  # away from the init, so norms and every expert matter
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    save_checkpoint(str(tmp_path / "save"), 1, [model], None, ctx, cfg, {})
    return model.eval()


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def exported(tmp_path, class_name):
    """The --format hf export of tmp_path/save, loaded by transformers; checks its class and tensor names."""
    transformers = pytest.importorskip("transformers")
    assert _merge_main(["--load", str(tmp_path / "save"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert type(model).__name__ == class_name
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def assert_same_logits(ours_model, hf_model):
    with torch.no_grad():
        ours = ours_model(tokens=tokens())[..., :VOCAB]
        theirs = hf_model(tokens()).logits.float()
    assert ours.std() > 0.05
    assert (ours - theirs).abs().max().item() < 1e-4


def test_mixtral_export_has_the_engines_logits_and_converts_back(tmp_path):
    model = saved_model(tmp_path, moe_config())
    hf = exported(tmp_path, "MixtralForCausalLM")
    assert hf.config.num_local_experts == 4 and hf.config.num_experts_per_tok == 2
    assert hf.config.intermediate_size == 24 and hf.config.router_jitter_noise == 0.0
    layer = hf.model.layers[1].mlp
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    chosen = layer.gate(x)[2]
    assert len(chosen.unique()) == 4, "every expert is used by some token: all of them are compared"
    assert_same_logits(model, hf)

    from convert_hf import main
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--seq-length", str(SEQ)]) == 0
    cfg = parse_config(["--config", os.path.join(tmp_path / "back", "model.yaml"), "--mock-data"])
    assert (cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.resolved_moe_ffn_hidden_size()) == (4, 2, 24)
    ctx = ParallelContext.virtual()
    back = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(str(tmp_path / "back"), [back], None, ctx, model_cfg=cfg.model)
    ours = dict(model.named_parameters())
    for name, p in back.named_parameters():
        rows = VOCAB if name in ("output", "word.weight", "embedding.word.weight") else p.shape[0]
        assert torch.equal(p[:rows], ours[name][:rows]), name
    assert_same_logits(back.eval(), hf)


@pytest.mark.parametrize("changes", [
    {"moe_shared_expert_intermediate_size": 40, "moe_layer_freq": "[0,1]"},
    {"moe_shared_expert_intermediate_size": 40, "add_qkv_bias": True, "moe_router_topk": 1},
], ids=["dense-first", "qkv-bias-top1"])
def test_shared_expert_exports_as_qwen2_moe_with_the_engines_logits(tmp_path, changes):
    cfg = moe_config(**changes)
    model = saved_model(tmp_path, cfg)
    hf = exported(tmp_path, "Qwen2MoeForCausalLM")
    c = hf.config
    assert c.mlp_only_layers == ([0] if "moe_layer_freq" in changes else []) and c.norm_topk_prob
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size, c.intermediate_size) == (24, 40, 48)
    gate = hf.model.layers[1].mlp.shared_expert_gate.weight
    assert not gate.any(), "a zero gate: sigmoid(0) = 1/2, undone by the doubled down projection"
    assert_same_logits(model, hf)


@pytest.mark.parametrize("changes,why", [
    ({"moe_router_score_function": "sigmoid"}, "the router scores with sigmoid"),
    ({"moe_router_enable_expert_bias": True}, "the router adds an expert bias"),
    ({"moe_expert_capacity_factor": 1.0}, "experts drop tokens over capacity"),
    ({"moe_router_topk_scaling_factor": 2.5}, "the routing weights are scaled by 2.5"),
    ({"moe_layer_freq": "[0,1]"}, "layers [0] are dense and there is no shared expert"),
    ({"add_qkv_bias": True}, "QKV biases without a shared expert"),
    ({"normalization": "LayerNorm"}, "the MoE model is not Llama-shaped"),
], ids=["sigmoid", "expert-bias", "capacity", "scaling", "dense-no-shared", "qkv-bias", "layernorm"])
def test_what_no_hf_family_computes_exactly_is_refused_in_one_line(tmp_path, capsys, changes, why):
    saved_model(tmp_path, moe_config(**changes))
    assert _merge_main(["--load", str(tmp_path / "save"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"merge_ckpt.py: error: --format hf: {why}") and err.count("\n") == 1, err
    assert err.rstrip().endswith("use --format native") and not os.path.exists(tmp_path / "hf" / "config.json")


def test_mixtral_config_rules_read_back_what_they_write():
    cfg = moe_config(num_layers=3, rotary_base=5e5, moe_router_topk=3)
    written = hf_config("mixtral", cfg)
    assert written["architectures"] == ["MixtralForCausalLM"] and written["sliding_window"] is None
    kind, fields = model_fields(json.loads(json.dumps(written)))
    m = cfg.model
    assert kind == "mixtral" and fields["ffn_hidden_size"] == 24 and fields["num_experts"] == 4
    assert all(fields[k] == getattr(m, k) for k in ("moe_router_topk", "num_layers", "rotary_base", "swiglu"))
    assert set(MOE_ARCHITECTURES) == {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}


def test_a_transformers_mixtral_converts_with_its_logits(tmp_path):
    """Import of a model transformers made (its defaults: rope_theta 1e6, rms_norm_eps 1e-5), tied embeddings."""
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    hf.save_pretrained(str(tmp_path / "hf"))
    from convert_hf import main
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--seq-length", str(SEQ)]) == 0
    cfg = parse_config(["--config", os.path.join(tmp_path / "ckpt", "model.yaml"), "--mock-data"])
    m = cfg.model
    assert (m.rotary_base, m.norm_epsilon, m.untie_embeddings_and_output_weights) == (1e6, 1e-5, False)
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(str(tmp_path / "ckpt"), [model], None, ctx, model_cfg=m)
    assert_same_logits(model.eval(), hf)


def test_a_mixtral_keeps_its_aux_loss_coefficient_through_import_training_and_export(tmp_path):
    """router_aux_loss_coef 0.02 becomes --moe-aux-loss-coeff 0.02 in model.yaml, the run trains with it (the log
    line's aux loss is not zero) and the export writes 0.02 back, with output_router_logits so that transformers
    adds the loss when it trains."""
    t = pytest.importorskip("transformers")
    from convert_hf import main
    from test_launcher import launch
    from test_trainer import read_records
    torch.manual_seed(0)
    t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    ).save_pretrained(str(tmp_path / "hf"))
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--seq-length", str(SEQ)]) == 0
    model_yaml = os.path.join(tmp_path / "ckpt", "model.yaml")
    assert parse_config(["--config", model_yaml, "--mock-data"]).model.moe_aux_loss_coeff == 0.02
    proc, _ = launch(["--config", model_yaml, "--mock-data", "--load", str(tmp_path / "ckpt"), "--save",
                      str(tmp_path / "run"), "--train-iters", "2", "--global-batch-size", "2", "--log-interval", "1"],
                     timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for r in read_records(str(tmp_path / "run" / "metrics.jsonl")) if "moe_aux_loss" in r]
    assert len(records) == 2 and all(r["moe_aux_loss"] > 0 for r in records)
    assert "moe aux loss: " in proc.stdout and "moe aux loss: 0.0000E+00" not in proc.stdout
    assert _merge_main(["--load", str(tmp_path / "run"), "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    written = json.load(open(tmp_path / "back" / "config.json"))
    assert (written["router_aux_loss_coef"], written["output_router_logits"]) == (0.02, True)
    assert t.AutoConfig.from_pretrained(str(tmp_path / "back")).router_aux_loss_coef == 0.02

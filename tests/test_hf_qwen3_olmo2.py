"""Qwen3, Qwen3-MoE and OLMo-2 to and from Hugging Face (engine/checkpoint/hf/qwen3.py, qwen3_moe.py, olmo2.py).

Tiny `transformers` models with random weights (nudged away from their init): Qwen3 with a head_dim of its own
(16, not hidden / heads = 8), Qwen3-MoE with a dense first layer and four experts that all get tokens, OLMo-2.
Checked: config.json rules in both directions and each refusal in one line (attention biases, another RoPE
type, un-renormalised routing weights; and on export, models no family computes; sliding windows import:
tests/test_hf_window.py); logits equal transformers' (fp32, 1e-5) at tp 1 and at tp 2 x pp 2 (sequence
parallel for the MoE); HF -> Ternion -> HF gives identical tensors; each trains 10 steps at tp 2 x pp 2 from
the converted weights with --finetune (first-step loss equal to transformers' on the same batch), exports
back, and the export's logits equal Ternion's for the trained weights; Qwen3's tokenizer, beside its
weights, goes through the run to the export and encodes the same. Budget on two cores: about 10 s with the pool of 4 ranks started (one run).
"""
import json
import os

import pytest
import torch

from engine.checkpoint.hf import MOE_ARCHITECTURES, hf_config, imported_config, model_fields
from engine.checkpoint.hf.families import export_family
from engine.config import Config, ConfigError
from engine.parallel.topology import build_context
from harness import run_ranks, tp2_pp2_logits_error
from test_hf_import import SEQ, VOCAB, check_finetuned, convert, finetune_args, lib, loaded, nudged, tokens

KINDS = ("qwen3", "qwen3_moe", "olmo2")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0])


def hf_model(kind: str):
    """A tiny transformers model of `kind` with random weights, in eval mode."""
    t = lib()
    make = {"qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON, head_dim=16)),
            "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16)),
            "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**COMMON, pad_token_id=None, eos_token_id=None))}[kind]
    return nudged(make)


def hf_config_dict(kind: str, **changes) -> dict:
    t = lib()
    config = {"qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16),
              "olmo2": lambda: t.Olmo2Config(**COMMON, pad_token_id=None, eos_token_id=None),
              "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **MOE, head_dim=16)}[kind]().to_dict()
    return config | changes


# ------------------------------------------------------------------ config.json rules and refusals

@pytest.mark.parametrize("kind", KINDS)
def test_config_rules_read_back_what_they_write(kind):
    kind_of, fields = model_fields(hf_config_dict(kind))
    assert kind_of == kind and fields["qk_layernorm"] and fields["disable_bias_linear"]
    cfg = Config()
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    m = cfg.model
    assert m.head_dim() == (8 if kind == "olmo2" else 16)  # OLMo-2's config.json has no head_dim: hidden / heads
    written = json.loads(json.dumps(hf_config(kind, cfg)))
    back_kind, back = model_fields(written)
    assert back_kind == kind and back == fields | {"kv_channels": m.head_dim()}
    assert (m.qk_layernorm_scope, m.norm_placement) == (("projection", "post") if kind == "olmo2" else ("head", "pre"))
    if kind == "qwen3_moe":
        assert m.moe_layers() == [1] and written["mlp_only_layers"] == [0] and written["num_experts"] == 4
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (4, 2, 24, 96)
        assert set(MOE_ARCHITECTURES) == {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}
        # decoder_sparse_step counts too: with step 2 and no list, layer 0 is dense and layer 1 MoE
        every_other = hf_config_dict(kind, mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=4)
        assert model_fields(every_other)[1]["moe_layer_freq"] == "[0,1,0,1]"


@pytest.mark.parametrize("kind,change,message", [
    ("qwen3", {"attention_bias": True}, "config.json attention_bias: True; Ternion supports False only"),
    ("olmo2", {"attention_bias": True}, "config.json attention_bias: True; Ternion supports False only"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope type 'yarn'"),
    ("qwen3_moe", {"norm_topk_prob": False}, "config.json norm_topk_prob: False; Ternion supports True only"),
], ids=["qwen3-bias", "olmo2-bias", "qwen3-yarn", "qwen3-moe-unnormalised"])
def test_what_ternion_cannot_express_is_refused_in_one_line(kind, change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        imported_config(hf_config_dict(kind, **change), SEQ)
    assert "\n" not in str(e.value)
    assert imported_config(hf_config_dict("qwen3", use_sliding_window=True, sliding_window=SEQ), SEQ)[0] == "qwen3"


@pytest.mark.parametrize("changes,why", [
    ({"qk_layernorm_scope": "projection"}, "QK-norm over the whole projection"),
    ({"moe_shared_expert_intermediate_size": 32}, "QK-norm with a shared expert"),
    ({"add_qkv_bias": True}, "QKV biases with QK-norm"),
    ({"norm_placement": "post"}, "the norms follow the sublayers"),
], ids=["projection", "shared-expert", "qkv-bias", "post-norm"])
def test_moe_models_no_family_computes_are_refused_on_export(changes, why):
    cfg = Config()
    fields = model_fields(hf_config_dict("qwen3_moe"))[1] | changes
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    with pytest.raises(ConfigError, match=f"--format hf: {why}") as e:
        export_family(cfg.model)
    assert str(e.value).endswith("use --format native") and "\n" not in str(e.value)


def test_a_dense_model_no_family_computes_is_refused_on_export():
    """OLMo-2's QK-norm with the norms before the sublayers (or Qwen3's with LayerNorm): neither family."""
    for kind, changes in (("olmo2", {"norm_placement": "pre"}), ("qwen3", {"normalization": "LayerNorm"})):
        cfg = Config()
        for name, value in (model_fields(hf_config_dict(kind))[1] | changes).items():
            setattr(cfg.model, name, value)
        with pytest.raises(ConfigError, match="--format hf: the model is neither Llama-shaped .* use --format native"):
            export_family(cfg.model)


# ------------------------------------------------------------------ tp 1: logits and round trip

@pytest.mark.parametrize("kind", KINDS)
def test_imported_logits_equal_transformers_and_the_round_trip_is_exact(tmp_path, kind):
    from merge_ckpt import main as merge
    model = hf_model(kind)
    ckpt, cfg = convert(model, tmp_path)
    x = tokens()
    with torch.no_grad():
        want = model(x).logits
        diff = (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - want).abs().max().item()
    assert want.std() > 0.1 and diff < 1e-5, diff
    if kind == "qwen3_moe":
        hidden = model.model.embed_tokens(x).reshape(-1, 64)
        chosen = model.model.layers[1].mlp.gate(hidden)[2]
        assert len(chosen.unique()) == 4, "every expert gets tokens: all of them are compared"
    assert merge(["--load", ckpt, "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    back, info = lib().AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert type(back) is type(model) and not any(info[k] for k in ("missing_keys", "unexpected_keys")), info
    theirs, ours = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    assert [k for k in theirs if not torch.equal(theirs[k], ours[k])] == []


# ------------------------------------------------------------------ tp 2 x pp 2, --finetune and the export

def _tp2_pp2(rank, world, cases, runs):
    """Each case's full logits at tp 2 x pp 2 (the first stage sends its hidden states to the last; `sp`: split
    over tp) against `want`; then the trainer runs each command line of `runs` in this process group."""
    from engine.cli import parse_config
    from engine.resolve import resolve
    from engine.training import Trainer
    from engine.validation import validate
    errors = []
    for cfg_dict, ckpt, x, want, sp in cases:
        errors += tp2_pp2_logits_error(rank, world, Config.from_dict(cfg_dict), ckpt, x, want, VOCAB, sp)
    for argv in runs:
        cfg = parse_config(argv)
        validate(cfg, world)
        ctx = build_context(world, rank, 2, 2, sequence_parallel=cfg.parallel.sequence_parallel,
                            seed=resolve(cfg, world).training.seed)
        Trainer(cfg, ctx, "cpu", log=lambda _line: None).train()
        ctx.destroy()
    return errors


def _tokenizer(path) -> str:
    """A small byte-level BPE saved as transformers saves one (tokenizer.json and its config); a text to encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = "Queries and keys are normalised before the rotary embedding; the norms follow the sublayers. " * 4
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=VOCAB - 20, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, fh)
    return text


def test_at_tp2_pp2_logits_equal_transformers_then_each_finetunes_and_exports(tmp_path):
    cases, runs, models, configs, text = [], [], {}, {}, None
    for kind in KINDS:
        models[kind] = model = hf_model(kind)
        if kind == "qwen3":  # the tokenizer beside the weights, as on the Hub
            os.makedirs(tmp_path / kind / "hf")
            text = _tokenizer(str(tmp_path / kind / "hf"))
        ckpt, configs[kind] = convert(model, tmp_path / kind)
        x = tokens()
        with torch.no_grad():
            cases.append((configs[kind].to_dict(), ckpt, x, model(x).logits, kind == "qwen3_moe"))
        runs.append(finetune_args(ckpt, tmp_path / kind) + (["--sequence-parallel"] if kind == "qwen3_moe" else []))
    assert configs["qwen3"].data.tokenizer_type == "HuggingFaceTokenizer"
    results = run_ranks(_tp2_pp2, 4, cases, runs, timeout=300)
    errors = [e for r in results for e in r]
    assert len(errors) == 2 * len(KINDS) and max(errors) < 1e-5, errors
    for kind in KINDS:
        check_finetuned(models[kind], configs[kind], tmp_path / kind)  # exports tmp_path/kind/back
        back = lib().AutoModelForCausalLM.from_pretrained(str(tmp_path / kind / "back")).eval()
        trained = loaded(str(tmp_path / kind / "run"), configs[kind])
        x = tokens(seed=2)
        with torch.no_grad():
            assert (trained(tokens=x)[..., :VOCAB] - back(x).logits).abs().max().item() < 1e-5, kind
    theirs = lib().AutoTokenizer.from_pretrained(str(tmp_path / "qwen3" / "hf"))
    exported = lib().AutoTokenizer.from_pretrained(str(tmp_path / "qwen3" / "back"))
    assert exported.encode(text) == theirs.encode(text) and len(theirs.encode(text)) > 10

"""Hugging Face models with sliding windows: Mistral, Mixtral and Qwen3-MoE (every layer), Qwen2 and Qwen3 (the
layers from max_window_layers on, or as layer_types says) import their window as --window-size W-1,0
(transformers' sliding_window W counts the query itself) and --window-attn-skip-freq, and export it back.

Tiny transformers models with random weights at SEQ 32, past their windows so the window matters: logits
equal transformers' (fp32, 1e-5) and differ without the window; merge_ckpt --format hf writes the window's
keys, transformers loads the folder with identical tensors and the same logits. What a family cannot say
(Mistral's window on every layer only, Qwen2's on the last layers only, no window in GPT-2 or Qwen2-MoE) is
one line. Budget on two cores: about 10 s.
"""
import json

import pytest
import torch

from engine.checkpoint.hf import FAMILIES, hf_config, model_fields
from engine.checkpoint.hf.families import export_family
from engine.config import Config, ConfigError
from test_hf_import import VOCAB, convert, lib, loaded, nudged, tokens

LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64)


def windowed(kind: str):
    """A tiny transformers model of `kind` whose window is shorter than SEQ, weights nudged off their init."""
    t = lib()
    make = {
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**LLAMA, sliding_window=8)),
        # layer 0 full, layer 1 with a window of 6 (max_window_layers counts the full layers before)
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=6,
                                                          max_window_layers=1)),
    }[kind]
    return nudged(make)


@pytest.mark.parametrize("kind,window_size,skip,written", [
    ("mistral", "7,0", None, {"architectures": ["MistralForCausalLM"], "sliding_window": 8}),
    ("qwen2", "5,0", "[0,1]", {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 6, "use_sliding_window": True,
                              "max_window_layers": 1, "layer_types": ["full_attention", "sliding_attention"]}),
])
def test_windowed_models_import_with_transformers_logits_and_export_back(tmp_path, kind, window_size, skip, written):
    from merge_ckpt import main as merge
    model = windowed(kind)
    ckpt, cfg = convert(model, tmp_path)
    assert (cfg.model.window_size, cfg.model.window_attn_skip_freq) == (window_size, skip)
    x = tokens()
    with torch.no_grad():
        want = model(x).logits
        diff = (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - want).abs().max().item()
        cfg.model.window_size = cfg.model.window_attn_skip_freq = None
        without = (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - want).abs().max().item()
    assert want.std() > 0.1 and diff < 1e-5 and without > 1e-3, (diff, without)
    assert merge(["--load", ckpt, "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: config[k] for k in written} == written
    back = lib().AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    theirs, ours = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours) and [k for k in theirs if not torch.equal(theirs[k], ours[k])] == []
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)


def _llama_shaped(**fields) -> Config:
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 4, 64, 8, 32, 500
    for name, value in (FAMILIES["llama"].shape | {"disable_bias_linear": True} | fields).items():
        setattr(m, name, value)
    return cfg


def test_window_keys_read_back_what_they_write():
    """transformers' W is our W-1 both ways; a Qwen2 layer_types list is read as the 0/1 skip list."""
    moe = {"num_experts": 4, "moe_router_topk": 2}
    for arch, fields, skip in (("mistral", {}, None), ("mixtral", moe, None),
                               ("qwen2", {"add_qkv_bias": True, "window_attn_skip_freq": "[0,0,1,1]"}, "[0,0,1,1]"),
                               ("qwen3", {"qk_layernorm": True, "window_attn_skip_freq": "[0,1,1,1]"}, "[0,1,1,1]"),
                               ("qwen3_moe", {"qk_layernorm": True} | moe, None)):
        cfg = _llama_shaped(window_size="15,0", **fields)
        assert export_family(cfg.model) == arch
        written = hf_config(arch, cfg)
        assert written["sliding_window"] == 16
        kind, read = model_fields(json.loads(json.dumps(written)))
        assert (kind, read["window_size"], read.get("window_attn_skip_freq")) == (arch, "15,0", skip)
    assert export_family(_llama_shaped().model) == "llama"  # no window: Llama, as before
    t = lib()
    qwen2 = t.Qwen2Config(**LLAMA | {"num_hidden_layers": 3}, use_sliding_window=True, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]).to_dict()
    assert model_fields(qwen2)[1]["window_attn_skip_freq"] == "[1,0,1]"
    off = t.Qwen2Config(**LLAMA, use_sliding_window=False, sliding_window=4096).to_dict()
    assert "window_size" not in model_fields(off)[1]
    none_windowed = t.Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=4, max_window_layers=2).to_dict()
    assert "window_size" not in model_fields(none_windowed)[1]
    assert model_fields({"model_type": "mistral", **LLAMA})[1]["window_size"] == "4095,0"  # transformers' default


@pytest.mark.parametrize("fields,arch,message", [
    ({"window_attn_skip_freq": "2"}, "mistral", "MistralForCausalLM applies its sliding window to every layer"),
    ({"add_qkv_bias": True, "window_attn_skip_freq": "[1,1,0,0]"}, "qwen2", "are not the last ones"),
    ({"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
      "disable_bias_linear": False}, None, "the model has a sliding window (--window-size 15,0)"),
    ({"num_experts": 4, "moe_shared_expert_intermediate_size": 32}, None, "Qwen2MoeForCausalLM cannot express"),
], ids=["mistral-mixed", "qwen2-not-last", "gpt2-shaped", "qwen2-moe"])
def test_a_window_no_family_can_say_is_one_line(fields, arch, message):
    cfg = _llama_shaped(window_size="15,0", **fields)
    with pytest.raises(ConfigError) as e:
        hf_config(arch, cfg) if arch else export_family(cfg.model)
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).endswith("use --format native")

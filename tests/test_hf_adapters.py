"""One adapter per Hugging Face family (engine/checkpoint/hf/): a family is its module and one registry entry.

Every registered family is the module engine/checkpoint/hf/<key>.py, whose ADAPTER holds its config.json rules
and tensor plan; the conversion code itself names no family. A toy family, defined here and registered at
run time, exports a tiny model through tools/merge_ckpt.py --format hf and imports it back through
tools/convert_hf.py with every tensor bitwise equal: no other file needs to know it. Budget: a few seconds.
"""
import ast
import importlib
import json
import os

import torch

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.hf import FAMILIES
from engine.checkpoint.hf.adapter import Adapter, Rule, has_shape, same
from engine.checkpoint.hf.transforms import QKV, WHOLE, Part, Transform, Transposed
from engine.cli import parse_config
from engine.config import Config
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks

HF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "checkpoint", "hf")
CONVERSION = ("__init__", "adapter", "transforms", "io", "config_json", "to_hf", "from_hf")  # family-free modules
VOCAB, SEQ = 100, 16


def test_every_family_is_one_module_holding_its_rules_and_plan():
    cfg = Config()
    for key, adapter in FAMILIES.items():
        module = importlib.import_module(f"engine.checkpoint.hf.{key}")
        assert os.path.dirname(os.path.abspath(module.__file__)) == HF_DIR and module.ADAPTER is adapter, key
        assert adapter.model_type == key and adapter.name.endswith(("ForCausalLM", "LMHeadModel"))
        keys = [rule.key for rule in adapter.rules]
        assert all(isinstance(rule, Rule) for rule in adapter.rules) and len(keys) == len(set(keys)), key
        for name, value in adapter.shape.items():
            setattr(cfg.model, name, value)
        assert all(isinstance(how, Transform) for _, _, how in adapter.plan(cfg.model)), key


def test_the_conversion_code_names_no_family():
    names = {key for key in FAMILIES} | {a.name for a in FAMILIES.values()}
    names |= {t for a in FAMILIES.values() for t in a.imports}
    for module in CONVERSION:
        with open(os.path.join(HF_DIR, module + ".py"), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names}
        named |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names}
        assert not named, f"{module}.py names {named}: that belongs in the family's module"


TOY_SHAPE = {"normalization": "LayerNorm", "position_embedding_type": "rope", "swiglu": True,
             "disable_bias_linear": True, "add_qkv_bias": False, "untie_embeddings_and_output_weights": True}


def _toy_plan(m) -> list:
    """Other names, fused QKV in q/k/v order, a transposed output projection: a layout no real family has."""
    plan = [("embed.weight", "word.weight", WHOLE)]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"blocks.{i}."
        plan += [(f"{dst}norm_a.{kind}", f"{src}norm1.{kind}", WHOLE) for kind in ("weight", "bias")]
        plan += [(dst + "wqkv", src + "attention.qkv.weight", QKV.of(m)),
                 (dst + "wo", src + "attention.proj.weight", Transposed())]
        plan += [(f"{dst}norm_b.{kind}", f"{src}norm2.{kind}", WHOLE) for kind in ("weight", "bias")]
        plan += [(dst + "w_gate", src + "mlp.fc1.weight", Part(0)), (dst + "w_up", src + "mlp.fc1.weight", Part(1)),
                 (dst + "w_down", src + "mlp.fc2.weight", WHOLE)]
    return plan + [("norm.weight", "final_norm.weight", WHOLE), ("norm.bias", "final_norm.bias", WHOLE),
                   ("head.weight", "output", WHOLE)]


TOY = Adapter(
    "ToyForCausalLM", "toy", TOY_SHAPE,
    (same("vocab_size", "vocab_size"), same("hidden_size", "hidden_size"), same("num_layers", "num_layers"),
     same("heads", "num_attention_heads"), same("groups", "num_query_groups", lambda m: m.resolved_query_groups()),
     same("ffn", "ffn_hidden_size", lambda m: m.resolved_ffn_hidden_size())),
    {}, _toy_plan, lambda m: not m.num_experts and has_shape(m, TOY_SHAPE), imports=("toy",))


def test_a_family_registered_at_run_time_round_trips_bitwise(tmp_path, monkeypatch):
    from convert_hf import main as convert
    merge = importlib.import_module("tools.merge_ckpt").main
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.seq_length = 2, 32, 4, 2, SEQ
    m.vocab_size, m.ffn_hidden_size = VOCAB, 48
    for name, value in TOY_SHAPE.items():
        setattr(m, name, value)
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx, vocab_size=VOCAB)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_checkpoint(str(tmp_path / "save"), 1, [model], None, ctx, cfg, {})
    assert merge(["--load", str(tmp_path / "save"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["ToyForCausalLM"] and config["groups"] == 2 and config["ffn"] == 48
    assert convert(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--seq-length", str(SEQ)]) == 0
    back_cfg = parse_config(["--config", str(tmp_path / "ckpt" / "model.yaml"), "--mock-data"])
    back = build_model_chunks(back_cfg, ctx)[0]
    load_checkpoint(str(tmp_path / "ckpt"), [back], None, ctx, model_cfg=back_cfg.model)
    ours, theirs = model.state_dict(), back.state_dict()
    rows = {"word.weight": VOCAB, "output": VOCAB}  # the rows past VOCAB are padding
    assert ours.keys() == theirs.keys()
    differ = [k for k in ours if not torch.equal(ours[k][:rows.get(k)], theirs[k][:rows.get(k)])]
    assert not differ, differ

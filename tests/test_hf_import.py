"""Starting from a Hugging Face model: tools/convert_hf.py, the model features it needs, and --finetune.

Tiny `transformers` models with random weights (nudged away from their init, so biases and norms matter)
are saved with save_pretrained and converted. Checked: config.json rules in both directions and the
refusals; logits equal to transformers' (fp32) at tp 1 for Llama, Llama 3 RoPE scaling, Qwen2, Mistral and
GPT-2 with either GELU, and at tp 2 x pp 2; HF -> Ternion -> HF gives identical tensors; Llama- and
GPT-2-shaped models train 10 steps at tp 2 x pp 2 from the converted weights with --finetune (first-step
loss equal to transformers' on the same batch) and export back; the conversion streams (peak RSS growth
near the largest tensor). Budget on two cores: about 25 s (one 4-rank pool run, a ~260 MB conversion in a
child process), plus about 20 s for the torchrun case (marked slow).
"""
import json
import os

import pytest
import torch

from engine.checkpoint import files, load_checkpoint
from engine.checkpoint.hf import ARCHITECTURES, hf_config, imported_config, model_fields
from engine.checkpoint.resume import ResumePoint, resume_point
from engine.cli import parse_config
from engine.config import CheckpointConfig, Config, ConfigError
from engine.parallel.topology import ParallelContext, build_context
from engine.pipeline.partition import build_model_chunks
from engine.validation import validate
from harness import peak_rss_growth, run_ranks, tp2_pp2_logits_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 300, 32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # scaling matters within SEQ


def lib():
    """transformers, imported when a test needs it (not by the rank processes that import this module)."""
    return pytest.importorskip("transformers")


def hf_model(kind: str):
    """A tiny transformers model of `kind` with random weights, in eval mode."""
    t = lib()
    llama = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=64)
    gpt2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    make = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**llama)),
        "llama3-rope": lambda: t.LlamaForCausalLM(t.LlamaConfig(**llama, rope_parameters=LLAMA3_ROPE)),
        "llama-tied": lambda: t.LlamaForCausalLM(t.LlamaConfig(**llama, tie_word_embeddings=True)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**llama | {"num_key_value_heads": 2})),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**llama, sliding_window=None)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(**gpt2)),  # gelu_new: tanh GELU
        "gpt2-exact": lambda: t.GPT2LMHeadModel(t.GPT2Config(**gpt2, activation_function="gelu")),
    }[kind]
    return nudged(make)


def nudged(make):
    """make()'s model (seed 0) in eval mode, every weight nudged off its init by seeded noise (std 0.05), so
    that no weight is a constant (norms at 1, biases at 0) a conversion could get wrong unseen."""
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model


def convert(model, root, **save) -> tuple:
    """save_pretrained into root/hf, tools/convert_hf.py into root/ckpt; (checkpoint dir, run Config)."""
    from convert_hf import main
    hf, ckpt = str(root / "hf"), str(root / "ckpt")
    model.save_pretrained(hf, **save)
    assert main(["--hf", hf, "--out", ckpt, "--seq-length", str(SEQ)]) == 0
    return ckpt, parse_config(["--config", os.path.join(ckpt, "model.yaml"), "--mock-data"])


def tokens(n=2, seed=1):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def loaded(ckpt: str, cfg):
    """The converted model on one rank, in eval mode."""
    ctx = ParallelContext.virtual()
    model = build_model_chunks(cfg, ctx)[0]
    load_checkpoint(ckpt, [model], None, ctx, model_cfg=cfg.model)
    return model.eval()


# ------------------------------------------------------------------ config.json rules

@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_config_rule_reads_back_what_it_writes(arch):
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 3, 64, 8, 32, 500
    for name, value in ARCHITECTURES[arch].shape.items():
        setattr(m, name, value)
    if arch != "gpt2":
        m.num_query_groups, m.rotary_base, m.use_rope_scaling, m.rope_scaling_factor = 2, 5e5, True, 4.0
    else:
        m.openai_gelu, m.hidden_dropout = True, 0.1
    written = hf_config(arch, cfg)
    kind, fields = model_fields(written)
    assert kind == arch and written["architectures"] == [ARCHITECTURES[arch].name]
    resolved = {"ffn_hidden_size": m.resolved_ffn_hidden_size(), "num_query_groups": m.resolved_query_groups(),
                "kv_channels": m.head_dim(), "max_position_embeddings": m.seq_length}
    assert fields == {k: resolved.get(k, getattr(m, k)) for k in fields}
    assert {"vocab_size", "num_layers", "hidden_size", "norm_epsilon", "init_method_std"} <= set(fields)
    assert written["bos_token_id"] is None and written["eos_token_id"] is None, "no tokenizer: no ids, never 50256"


@pytest.mark.parametrize("change,message", [
    ({"model_type": "falcon"}, "model_type 'falcon': Ternion imports llama, mistral, qwen2, gpt2"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu'; Ternion supports 'silu' only"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"attention_bias": True, "mlp_bias": False}, "mlp_bias False and attention_bias True: Ternion has one setting"),
], ids=["architecture", "activation", "rope", "biases"])
def test_what_ternion_cannot_express_is_refused_in_one_line(change, message):
    hf = lib().LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=8).to_dict() | change
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        imported_config(hf, SEQ)
    window = lib().MistralConfig(sliding_window=16).to_dict()
    assert imported_config(window)[1].model.window_size == "15,0"  # imported (tests/test_hf_window.py)
    old = lib().GPT2Config(scale_attn_by_inverse_layer_idx=True).to_dict()
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx: True"):
        imported_config(old)


def test_new_model_flags_are_checked():
    for argv, message in ((["--openai-gelu", "--swiglu"], "--openai-gelu with --swiglu"),
                          (["--use-rope-scaling"], "--use-rope-scaling with --position-embedding-type learned"),
                          (["--use-rope-scaling", "--position-embedding-type", "rope", "--rope-scaling-low-freq-factor",
                            "5"], "--rope-scaling-low-freq-factor 5.0: must be positive and below"),
                          (["--finetune"], "--finetune without --load")):
        with pytest.raises(ConfigError, match=message):
            validate(parse_config(["--mock-data", *argv]), 1)


def test_convert_hf_user_errors_are_one_line(tmp_path, capsys):
    from convert_hf import main
    ckpt, _ = convert(hf_model("llama"), tmp_path)
    capsys.readouterr()
    for argv, message in ((["--hf", str(tmp_path / "none")], f"{tmp_path / 'none'}/config.json not found"),
                          (["--hf", str(tmp_path / "hf"), "--out", ckpt], f"--out {ckpt}: already holds a checkpoint"),
                          (["--hf", str(tmp_path / "hf"), "--tokenizer-type", "HuggingFaceTokenizer"],
                           "--tokenizer-type HuggingFaceTokenizer: its files are not in")):
        assert main(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "new")])) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"convert_hf.py: error: {message}") and err.count("\n") == 1, err


def test_the_tokenizer_beside_the_weights_is_recorded(tmp_path):
    from convert_hf import tokenizer_fields
    cases = {"sp": (["tokenizer.model", "tokenizer.json"], {"tokenizer_type": "SentencePieceTokenizer",
                                                            "tokenizer_model": "tokenizer.model"}),
             "hf": (["tokenizer.json"], {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "."}),
             "bpe": (["vocab.json", "merges.txt"], {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json",
                                                   "merge_file": "merges.txt"})}
    for case, (names, want) in cases.items():
        (tmp_path / case).mkdir()
        for name in names:
            (tmp_path / case / name).write_text("")
        fields, note = tokenizer_fields(str(tmp_path / case))
        assert note is None and fields == {k: v if k == "tokenizer_type" else os.path.normpath(tmp_path / case / v)
                                           for k, v in want.items()}
    assert tokenizer_fields(str(tmp_path / "sp"), "HuggingFaceTokenizer")[0]["tokenizer_model"] == str(tmp_path / "sp")
    assert tokenizer_fields(str(tmp_path))[0] == {} and "no tokenizer files" in tokenizer_fields(str(tmp_path))[1]
    with pytest.raises(ConfigError, match="--tokenizer-type GPT2BPETokenizer: its files are not in"):
        tokenizer_fields(str(tmp_path / "hf"), "GPT2BPETokenizer")


def test_planner_counts_the_qkv_bias():
    from engine.layout import Layout
    from engine.planner.params import params_per_rank
    from engine.planner.verify import meta_params_per_rank
    cfg = parse_config(["--mock-data", "--vocab-size", "256", "--normalization", "RMSNorm", "--swiglu",
                        "--position-embedding-type", "rope", "--disable-bias-linear", "--add-qkv-bias",
                        "--num-query-groups", "2"])
    for layout in (Layout(1, 1, 1), Layout(2, 2, 1)):
        assert params_per_rank(cfg.model, layout) == meta_params_per_rank(cfg, layout)


# ------------------------------------------------------------------ --finetune and --pretrained-checkpoint

def test_finetune_applies_to_load_and_pretrained_never_to_the_runs_own_save(tmp_path):
    import shutil
    ckpt, _ = convert(hf_model("llama"), tmp_path)
    save, empty = str(tmp_path / "run"), str(tmp_path / "empty")
    os.makedirs(empty)
    latest = files.read_latest
    assert resume_point(CheckpointConfig(load=ckpt, finetune=True), latest) == ResumePoint(ckpt, finetune=True)
    point = resume_point(CheckpointConfig(load=empty, save=empty, pretrained_checkpoint=ckpt), latest)
    assert point == ResumePoint(ckpt, finetune=True)
    assert point.start({"iteration": 7, "consumed_samples": 9, "data": {}, "guard": {}, "config": {"a": 1}}) == \
        {"iteration": 0, "consumed_samples": 0, "config": {"a": 1}, "finetune": ckpt}
    shutil.copytree(ckpt, save)
    assert resume_point(CheckpointConfig(load=ckpt, save=save, finetune=True), latest) == ResumePoint(save)
    with pytest.raises(ConfigError, match="--pretrained-checkpoint .*empty: no checkpoint there"):
        resume_point(CheckpointConfig(pretrained_checkpoint=empty), latest)


# ------------------------------------------------------------------ logits and round trip

@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "llama-tied", "qwen2", "mistral", "gpt2", "gpt2-exact"])
def test_imported_logits_equal_transformers_and_the_round_trip_is_exact(tmp_path, kind):
    from merge_ckpt import main as merge
    model = hf_model(kind)
    sharded = {"max_shard_size": "12KB"} if kind == "llama" else {}  # several files and an index
    ckpt, cfg = convert(model, tmp_path, **sharded)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json") == bool(sharded)
    x = tokens()
    with torch.no_grad():
        want = model(x).logits
        diff = (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - want).abs().max().item()
        if kind == "llama3-rope":  # the scaling matters at this length: without it the logits differ
            cfg.model.use_rope_scaling = False
            assert (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - want).abs().max().item() > 1e-3
    assert want.std() > 0.1 and diff < 1e-5, diff
    assert merge(["--load", ckpt, "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    back = lib().AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    theirs, ours = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    assert [k for k in theirs if not torch.equal(theirs[k], ours[k])] == []


def test_files_as_the_hub_has_them(tmp_path):
    """GPT-2 saved as GPT2Model (no `transformer.` prefix, the old attention-mask buffers), and a Llama 3
    config.json from before transformers 5 (rope_theta and rope_scaling at the top) read as the new format."""
    from convert_hf import main
    from safetensors.torch import load_file, save_file
    model = hf_model("gpt2")
    hf, ckpt = tmp_path / "hf", str(tmp_path / "ckpt")
    model.save_pretrained(hf)
    hub = {k.removeprefix("transformer."): v for k, v in load_file(hf / "model.safetensors").items()
           if k != "lm_head.weight"}
    save_file(hub | {"h.0.attn.bias": torch.ones(1, 1, 64, 64)}, hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["--hf", str(hf), "--out", ckpt, "--seq-length", str(SEQ)]) == 0
    cfg = parse_config(["--config", os.path.join(ckpt, "model.yaml"), "--mock-data"])
    x = tokens()
    with torch.no_grad():
        assert (loaded(ckpt, cfg)(tokens=x)[..., :VOCAB] - model(x).logits).abs().max().item() < 1e-5
    new = lib().LlamaConfig(vocab_size=VOCAB, rope_parameters=LLAMA3_ROPE).to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"} | {"rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE}
    assert model_fields(old) == model_fields(new) and model_fields(new)[1]["rope_scaling_factor"] == 8.0


def _tp2_pp2(rank, world, cases, finetune):
    """Each case's full logits at tp 2 x pp 2 (the first stage sends its hidden states to the last) against
    `want`; then the trainer runs the command line `finetune` in this process group, as the launcher would."""
    from engine.resolve import resolve
    from engine.training import Trainer
    errors = []
    for cfg_dict, ckpt, x, want in cases:
        errors += tp2_pp2_logits_error(rank, world, Config.from_dict(cfg_dict), ckpt, x, want, VOCAB)
    cfg = parse_config(finetune)
    validate(cfg, world)
    ctx = build_context(world, rank, 2, 2, seed=resolve(cfg, world).training.seed)
    Trainer(cfg, ctx, "cpu", log=lambda _line: None).train()
    ctx.destroy()
    return errors


def finetune_args(ckpt: str, tmp_path) -> list:
    """Train 10 steps at tp 2 x pp 2 from the converted weights (4 ranks)."""
    return ["--config", os.path.join(ckpt, "model.yaml"), "--load", ckpt, "--finetune", "--save", str(tmp_path / "run"),
            "--mock-data", "--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "10", "--lr", "3e-3", "--metrics-file", str(tmp_path / "metrics.jsonl")]


def check_finetuned(model, cfg, tmp_path) -> None:
    """The first step's loss is transformers' on the same batch; the export loads and carries the training."""
    from merge_ckpt import main as merge

    from engine.data.mock import MockGPTDataset
    from test_trainer import last_train_records, read_records
    records = last_train_records(read_records(str(tmp_path / "metrics.jsonl")))
    data = MockGPTDataset(SEQ, VOCAB, 4, cfg.training.seed)  # the first global batch: samples 0-3
    batch = torch.stack([torch.from_numpy(data[i]) for i in range(4)])

    def loss_of(m):
        with torch.no_grad():
            logits = m(batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    first = loss_of(model)
    assert sorted(records) == list(range(1, 11)) and abs(records[1]["lm_loss"] - first) < 1e-5, (records[1], first)
    assert merge(["--load", str(tmp_path / "run"), "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    back, info = lib().AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert type(back) is type(model) and not info["missing_keys"] and not info["unexpected_keys"], info
    assert loss_of(back.eval()) < first - 0.05, "the export does not carry the 10 steps of training"


def test_at_tp2_pp2_logits_equal_transformers_and_gpt2_finetunes(tmp_path):
    """Qwen2 (grouped-query attention, QKV biases) and GPT-2 (the tied embedding on two stages): logits; then
    the GPT-2 trains from its converted weights (in the rank pool: the Llama case below runs under torchrun)."""
    cases, models = [], {}
    for kind in ("qwen2", "gpt2"):
        models[kind] = hf_model(kind)
        ckpt, cfg = convert(models[kind], tmp_path / kind)
        x = tokens()
        with torch.no_grad():
            cases.append((cfg.to_dict(), ckpt, x, models[kind](x).logits))
    results = run_ranks(_tp2_pp2, 4, cases, finetune_args(ckpt, tmp_path / "gpt2"))
    errors = [e for r in results for e in r]
    assert len(errors) == 4 and max(errors) < 1e-5, errors
    check_finetuned(models["gpt2"], cfg, tmp_path / "gpt2")


@pytest.mark.slow
def test_convert_finetune_at_tp2_pp2_under_torchrun_and_export(tmp_path):
    """The acceptance path as a user runs it: convert_hf.py, the launcher with --finetune, merge_ckpt.py --format hf."""
    from test_trainer import launch
    model = hf_model("llama")
    ckpt, cfg = convert(model, tmp_path)
    code, output, _ = launch(finetune_args(ckpt, tmp_path), 4, timeout=150)
    assert code == 0, output[-6000:]
    assert f"--finetune: model weights from {ckpt}; starting at iteration 0 with a fresh optimizer" in output
    check_finetuned(model, cfg, tmp_path)


# ------------------------------------------------------------------ streaming

def llama_shapes(h: int, ffn: int, layers: int, vocab: int) -> dict:
    """Every tensor of an untied Llama (multi-head attention) in transformers' names, with its shape: what a
    streaming test writes to disk without transformers."""
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {f"{p}self_attn.{n}_proj.weight": (h, h) for n in "qkvo"}
        shapes |= {f"{p}mlp.{n}_proj.weight": (ffn, h) for n in ("gate", "up")} | {p + "mlp.down_proj.weight": (h, ffn)}
    return shapes


def test_conversion_streams_tensor_by_tensor(tmp_path):
    """A ~250 MB Llama-shaped folder in two shards, written without transformers; the peak RSS growth of the
    converting process, sampled every millisecond, stays near two copies of the largest tensor."""
    hf = tmp_path / "hf"
    hf.mkdir()
    h, ffn, layers, vocab = 1024, 2816, 4, 8000
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": h, "intermediate_size": ffn,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    (hf / "config.json").write_text(json.dumps(config))
    shapes = llama_shapes(h, ffn, layers, vocab)
    names = sorted(shapes)
    halves = {"model-1.safetensors": names[: len(names) // 2], "model-2.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        files.write_safetensors(str(hf / file), [(n, torch.float32, shapes[n]) for n in part],
                                ((n, torch.randn(shapes[n]) * 0.02) for n in part))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for f, p in halves.items()
                                                                                 for n in p}}))
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values()) * 8064 // 8000  # padded to 63 x 128 rows
    code, peak, err = peak_rss_growth("convert_hf", ["--hf", str(hf), "--out", str(tmp_path / "ckpt"),
                                                     "--seq-length", "64"], [ROOT, os.path.join(ROOT, "tools")])
    assert code == 0, err
    print(f"model {total / 2**20:.0f} MB, largest tensor {largest / 2**20:.1f} MB, "
          f"peak RSS growth {peak / 2**20:.1f} MB")
    assert total > 240e6 and peak < 2 * largest + 64 * 2 ** 20, peak

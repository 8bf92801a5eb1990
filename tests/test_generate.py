"""tools/generate.py on a tiny random model saved in the merged format (and as a run's checkpoint)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from engine.config import Config
from engine.data.tokenizer_training import train_sentencepiece
from engine.model import GPTModel
from engine.parallel.layers import spec_of
from engine.parallel.topology import ParallelContext
from harness import run_ranks
from tools import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ["the cat sat on the mat and the dog ran after the cat",
        "a quick brown fox jumps over the lazy dog near the river bank",
        "seven wizards box jaunty nymphs while the old towers stand"] * 40


def tiny_config(tokenizer_model, vocab_size):
    cfg = Config()
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.0  # Megatron-LM's 0.1 is the default
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    m.vocab_size, m.make_vocab_size_divisible_by = vocab_size, 64
    cfg.data.tokenizer_model = tokenizer_model
    cfg.training.seed = 7
    return cfg


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(merged dir, the original model, cfg, tokenizer) with weights as merge_ckpt.py writes them."""
    d = tmp_path_factory.mktemp("gen")
    tok = train_sentencepiece(TEXT, str(d / "tok"), vocab_size=300, num_threads=1)
    cfg = tiny_config(str(d / "tok.model"), tok.vocab_size)
    model = GPTModel(cfg.model, ParallelContext(), vocab_size=tok.vocab_size, seed=7).eval()
    assert model.padded_vocab > tok.vocab_size  # the padding must be dropped on save and restored on load
    tensors = {name: p[:spec_of(p).valid_rows or p.shape[0]].detach().contiguous() for name, p in model.named_parameters()}
    out = d / "merged"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"format": "ternion-merged", "iteration": 3,
                                                 "vocab_size": tok.vocab_size, "config": cfg.to_dict()}))
    return out, model, cfg, tok


def test_load_merged_gives_the_same_logits(merged):
    path, original, _, tok = merged
    model, cfg, vocab = generate.load_model(str(path))
    assert vocab == tok.vocab_size and cfg.model.hidden_size == 32
    x = torch.tensor([tok.encode("the cat sat on")])
    with torch.no_grad():
        assert torch.allclose(model(x)[..., :vocab], original(x)[..., :vocab], atol=1e-6)


def test_greedy_is_deterministic_and_sampling_follows_the_seed(merged):
    path, original, cfg, tok = merged
    model, _, vocab = generate.load_model(str(path))
    prompt = tok.encode("the quick brown fox")
    first = generate.generate(model, prompt, 20, vocab, cfg.model.seq_length)
    assert len(first) == 20 and all(0 <= t < vocab for t in first)  # contexts pass seq-length: cut to 16
    assert generate.generate(model, prompt, 20, vocab, cfg.model.seq_length, top_k=1) == first
    with torch.no_grad():
        assert first[0] == int(original(torch.tensor([prompt]))[0, -1, :vocab].argmax())
    sample = lambda seed: generate.generate(model, prompt, 20, vocab, 16, top_k=40, temperature=2.0,  # noqa: E731
                                            generator=torch.Generator().manual_seed(seed))
    assert sample(1) == sample(1) and sample(1) != sample(2) and sample(1) != first
    stopped = generate.generate(model, prompt, 20, vocab, 16, stop_token=first[2])
    assert stopped == first[:first.index(first[2]) + 1]  # stops at the first occurrence, included


def test_cli_prints_the_prompt_and_its_greedy_continuation(merged):
    path = merged[0]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", str(path), "--prompt",
           "the cat", "--max-new-tokens", "8"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    model, cfg, vocab = generate.load_model(str(path))
    prompt = merged[3].encode("the cat")
    new = generate.generate(model, prompt, 8, vocab, cfg.model.seq_length, stop_token=merged[3].eod)
    expected = merged[3].decode(prompt + new)
    assert run.stdout == expected + "\n" and expected.startswith("the cat") and expected[len("the cat"):].strip()


def test_user_mistakes_are_one_line(merged, tmp_path, capsys):
    path, _, _, _ = merged
    cases = ((["--load", str(tmp_path / "nope")], "directory not found"),
             (["--load", str(tmp_path)], "neither a merged checkpoint"),
             (["--load", str(path), "--tokenizer-model", str(tmp_path / "x.model")], "file not found"),
             (["--load", str(path), "--max-new-tokens", "0"], "--max-new-tokens"),
             (["--load", str(path), "--temperature", "0"], "--temperature"))
    for argv, needle in cases:
        assert generate.main(argv + ["--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def _save_run(rank, world_size, save_dir, cfg_dict, vocab_size):
    from engine.checkpoint import save_checkpoint
    from engine.parallel.topology import build_context
    cfg = Config.from_dict(cfg_dict)
    ctx = build_context(world_size, rank, 1, 1, seed=cfg.training.seed)
    model = GPTModel(cfg.model, ctx, vocab_size=vocab_size, seed=cfg.training.seed)
    save_checkpoint(save_dir, 5, [model], None, ctx, cfg, {"consumed_samples": 0})
    ctx.destroy()


def test_loads_a_run_checkpoint_directly(merged, tmp_path):
    path, original, cfg, tok = merged
    save_dir = str(tmp_path / "run")
    run_ranks(_save_run, 1, save_dir, cfg.to_dict(), tok.vocab_size, timeout=120)
    model, _, vocab = generate.load_model(save_dir)
    x = torch.tensor([tok.encode("a quick brown")])
    with torch.no_grad():
        assert torch.allclose(model(x)[..., :vocab], original(x)[..., :vocab], atol=1e-6)

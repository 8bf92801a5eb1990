"""--decoupled-lr / --decoupled-min-lr with Megatron-LM's meaning: the word embedding and the output layer on a
schedule of their own (the same warm-up and decay between --decoupled-lr and --decoupled-min-lr, default --min-lr).

The oracle is megatron-core 0.16.1 (tests/megatron_oracle.py, in the process tests/test_megatron_checkpoint.py starts
once, which runs `group_jobs` and calls `check_rates`): its _get_param_groups with Megatron-LM's overrides and its
OptimizerParamScheduler give every parameter of a GPT-2-shaped model (tied embedding, learned positions, biases) and a
Llama-shaped one (untied output layer) an LR and a weight decay at each position of the schedule; Ternion's optimizer
groups and rates give each parameter (matched by engine/checkpoint/megatron's name table) the same values, exactly.
Here: the step applies the decoupled rate to those tables only, the flags are checked, and (slow) a run with them
resumes from its checkpoint on the same losses.
"""
import json
import os

import pytest
from test_launcher import launch
from test_trainer import last_train_records, read_records

from engine.checkpoint.megatron.tables import plan
from engine.cli import parse_config
from engine.config import ConfigError
from engine.optim import build_optimizer
from engine.optim.schedule import rates_at_sample
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.report import optimizer_lines
from engine.resolve import resolve
from engine.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # megatron_oracle.SHAPES as Ternion flags, with the schedule each is checked on
    "gpt": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
             "--max-position-embeddings", "64"],
            dict(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=None, style="linear")),
    "llama": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "2",
               "--ffn-hidden-size", "96", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
              dict(lr=1.5e-4, min_lr=1e-5, decoupled_lr=5e-4, decoupled_min_lr=4.5e-5, style="cosine")),
}
WARMUP, DECAY, WD, POSITIONS = 6, 40, 0.1, list(range(0, 46, 3))


def ternion_rates(flags: list, s: dict) -> tuple:
    """(config, Ternion parameter name -> [(lr, weight decay)] at POSITIONS) from the optimizer's groups and the
    step's StepLR."""
    argv = ["--mock-data", "--seq-length", "32", "--vocab-size", "256", *flags, "--lr", str(s["lr"]), "--min-lr",
            str(s["min_lr"]), "--decoupled-lr", str(s["decoupled_lr"]), "--lr-decay-style", s["style"],
            "--weight-decay", str(WD), "--train-samples", str(DECAY), "--lr-warmup-samples", str(WARMUP),
            "--global-batch-size", "1"]
    if s["decoupled_min_lr"] is not None:
        argv += ["--decoupled-min-lr", str(s["decoupled_min_lr"])]
    cfg = parse_config(argv)
    validate(cfg, 1)
    resolve(cfg, 1)
    ctx = ParallelContext.virtual()
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size)
    opt = build_optimizer(cfg, chunks, ctx)
    group_of = {id(t): g for g in opt.adam.param_groups for t in g["params"]}
    out = {}
    for e in opt._entries:
        group = group_of[id(e.master)]
        rates = [rates_at_sample(p, cfg.optim, cfg.training) for p in POSITIONS]
        out[e.name] = [(r.decoupled if group.get("decoupled") else float(r), group["weight_decay"]) for r in rates]
    return cfg, out


def group_jobs(root) -> list:
    """The oracle's jobs (tests/test_megatron_checkpoint.py's megatron-core process runs them with its own)."""
    return [dict(op="groups", shape=name, out=str(root / f"{name}.groups.json"), init_lr=0.0, warmup=WARMUP,
                 decay=DECAY, positions=POSITIONS, weight_decay=WD, **s) for name, (_, s) in SHAPES.items()]


def check_rates(root, shape: str) -> None:
    """Every parameter's LR and weight decay at every position equal megatron-core's (written by group_jobs)."""
    flags, schedule = SHAPES[shape]
    cfg, ours = ternion_rates(flags, schedule)
    theirs = json.load(open(root / f"{shape}.groups.json"))
    names = {}
    for entry in plan(cfg.model):
        present = [n for n in entry.names if n in theirs]
        assert len(present) == 1, (entry, sorted(theirs))
        names[entry.ours] = present[0]
    assert set(names) == set(ours) and set(names.values()) == set(theirs)
    decoupled = {n for n, m in names.items() if m in ("embedding.word_embeddings.weight", "output_layer.weight")}
    assert decoupled == ({"word.weight"} if shape == "gpt" else {"word.weight", "output"})
    for ours_name, megatron_name in names.items():
        assert ours[ours_name] == [tuple(r) for r in theirs[megatron_name]], ours_name
    # the schedules differ where they should: the embedding's peak is --decoupled-lr, a weight's is --lr
    peak = POSITIONS.index(WARMUP)
    assert ours["word.weight"][peak][0] == schedule["decoupled_lr"] and ours["layers.0.attention.qkv.weight"][peak][0] \
        == schedule["lr"]


def test_the_flags_are_checked():
    for argv, line in ((["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05: applies with --decoupled-lr only"),
                       (["--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4"], "--decoupled-lr 1e-05: must be at "
                                                                                   "least its minimum")):
        with pytest.raises(ConfigError) as info:
            validate(parse_config(["--mock-data", *argv]), 1)
        assert str(info.value).startswith(line), str(info.value)


def test_the_step_gives_the_tables_the_decoupled_rate():
    """An update at StepLR(0, 1e-2): the word embedding and the output layer move (AdamW's first step, about the
    LR per element), every other parameter stays; without --decoupled-lr every parameter takes the main rate."""
    import torch

    from engine.optim.schedule import StepLR
    flags, _ = SHAPES["llama"]
    for decoupled in (True, False):
        cfg = parse_config(["--mock-data", "--seq-length", "32", "--vocab-size", "256", *flags, "--lr", "1e-2"]
                           + (["--decoupled-lr", "1e-2"] if decoupled else []))
        resolve(cfg, 1)
        ctx = ParallelContext.virtual()
        model = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size)[0]
        opt = build_optimizer(cfg, [model], ctx)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for e in opt._entries:
            e.master.grad.fill_(1.0)
        opt.update(StepLR(0.0, 1e-2), 1.0)
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert moved == ({"word.weight", "output"} if decoupled else set())
        step = (before["word.weight"] - model.word.weight).abs()
        assert not decoupled or torch.allclose(step, torch.full_like(step, 1e-2), rtol=0.15)
        lines = optimizer_lines(cfg, ctx, [model])
        assert lines[1:] == (["  the word embedding and output layer on their own LR schedule: --decoupled-lr 0.01 "
                              "down to 0 (the others: --lr 0.01 down to 0)"] if decoupled else [])


@pytest.mark.slow
def test_a_decoupled_run_resumes_on_its_losses(tmp_path):
    """Saved at iteration 3 of 6 and resumed: iterations 4-6 equal the uninterrupted run's, bit for bit."""
    from test_trainer import checkpoint_holding
    args = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
            "--untie-embeddings-and-output-weights", "--train-iters", "6", "--lr-warmup-iters", "1", "--log-interval",
            "1", "--decoupled-lr", "3e-2", "--decoupled-min-lr", "1e-3", "--save-interval", "3"]

    def run(save, *extra):
        proc, _ = launch(args + ["--save", str(save), "--metrics-file", str(save / "m.jsonl"), *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {i: r["lm_loss"] for i, r in last_train_records(read_records(str(save / "m.jsonl"))).items()}

    straight = run(tmp_path / "straight")
    (tmp_path / "at3").mkdir()
    resumed = run(tmp_path / "resumed", "--load", str(checkpoint_holding(tmp_path / "straight", 3, tmp_path / "at3")))
    assert sorted(resumed) == [4, 5, 6] and [resumed[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)]

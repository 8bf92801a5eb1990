"""Resume never changes the model silently (issue 37): every model setting the checkpoint records is compared with
the run's. One that keeps every tensor's shape (--moe-router-topk, --moe-router-score-function,
--moe-expert-capacity-factor, --rotary-base) is refused in one line naming the flag and both values, unless
--override-model-config (or --finetune) says it is meant; one that changes shapes (MoE -> dense) names the flag,
not a tensor. A one-rank MoE + RoPE checkpoint, then the trainer's own start-up (in one spawned rank) per case.
Budget: about 10 s.
"""
import pytest

from engine.config import Config
from engine.config.model_changes import model_differences
from harness import run_ranks

MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
         "--make-vocab-size-divisible-by", "16", "--position-embedding-type", "rope", "--swiglu",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"]

CHANGES = [(["--moe-router-topk", "1"], "--moe-router-topk 2 (this run: 1)"),
           (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function softmax (this run: sigmoid)"),
           (["--moe-expert-capacity-factor", "1.5"], "--moe-expert-capacity-factor not set (this run: 1.5)"),
           (["--rotary-base", "500000"], "--rotary-base 10000.0 (this run: 500000.0)")]


def _start(rank, world, cases):
    """Each case (argv): the trainer's start-up in this rank; the ConfigError's text or the lines it logged."""
    from engine.cli import parse_config
    from engine.config import ConfigError
    from engine.parallel.topology import build_context
    from engine.resolve import resolve
    from engine.training import Trainer
    from engine.validation import validate
    out = []
    for argv, train in cases:
        cfg = parse_config(argv)
        validate(cfg, world)
        ctx = build_context(world, rank, 1, 1, seed=resolve(cfg, world).training.seed)
        lines, trainer = [], None
        try:
            trainer = Trainer(cfg, ctx, "cpu", log=lines.append)
            trainer.train() if train else trainer.start()
            out.append(("ok", lines))
        except ConfigError as e:
            out.append(("refused", str(e)))
        finally:
            if trainer is not None:
                trainer.preemption.restore()  # SIGTERM ends this rank again
            ctx.destroy()
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_model")
    save = str(root / "moe")
    metrics = ["--metrics-file", str(root / "m.jsonl")]
    resume = MODEL + ["--load", save, "--train-iters", "4"] + metrics
    cases = [(MODEL + ["--save", save, "--train-iters", "2", "--save-interval", "2"] + metrics, True)]
    cases += [(resume + change, False) for change, _ in CHANGES]
    cases += [(resume + change + ["--override-model-config"], False) for change, _ in CHANGES]
    cases += [(resume + CHANGES[0][0] + ["--finetune"], False)]
    moe = MODEL.index("--num-experts")
    dense = MODEL[:moe] + MODEL[moe + 6:] + resume[len(MODEL):]
    cases += [(dense, False), (resume, False)]
    return run_ranks(_start, 1, cases, timeout=240)[0]


@pytest.mark.parametrize("n", range(len(CHANGES)))
def test_a_setting_that_keeps_shapes_is_refused_in_one_line_naming_the_flag_and_both_values(outcomes, n):
    assert outcomes[0][0] == "ok"
    kind, text = outcomes[1 + n]
    assert kind == "refused" and "\n" not in text, text
    assert text.startswith("the model differs from the one the checkpoint in ") and CHANGES[n][1] in text
    assert text.endswith("resume with the checkpoint's values, or pass --override-model-config to train on with "
                         "this run's")


@pytest.mark.parametrize("n", range(len(CHANGES)))
def test_the_override_flag_accepts_the_change_and_lists_it(outcomes, n):
    kind, lines = outcomes[1 + len(CHANGES) + n]
    assert kind == "ok", lines
    said = [line for line in lines if line.startswith("model settings changed from the checkpoint's")]
    assert len(said) == 1 and "(--override-model-config): " + CHANGES[n][1] in said[0]
    assert any(line.startswith("resumed from ") and "at iteration 2" in line for line in lines)


def test_finetune_takes_the_weights_of_a_changed_model_and_says_what_changed(outcomes):
    kind, lines = outcomes[1 + 2 * len(CHANGES)]
    assert kind == "ok", lines
    assert any("(--finetune): --moe-router-topk 2 (this run: 1)" in line for line in lines)


def test_moe_to_dense_names_the_flag_not_a_tensor(outcomes):
    kind, text = outcomes[2 + 2 * len(CHANGES)]
    assert kind == "refused" and "\n" not in text
    assert "was saved with --num-experts 4 (this run: --num-experts not set)" in text
    assert "tensor" not in text and "experts." not in text and "layers." not in text


def test_the_same_model_resumes_without_a_word_about_settings(outcomes):
    kind, lines = outcomes[3 + 2 * len(CHANGES)]
    assert kind == "ok" and not any("model settings" in line for line in lines), lines


def test_defaults_and_what_they_resolve_to_are_the_same_model_and_unused_settings_are_not_compared():
    run = Config().model
    run.vocab_size = 256
    saved = Config().to_dict()["model"]
    saved.update(vocab_size=256, ffn_hidden_size=256, rotary_base=5e5, moe_router_topk=1, attention_backend="local",
                 recompute_granularity="full", init_method_std=0.1)
    assert model_differences(saved, run) == []  # 4 x hidden; learned positions; no experts; how, not what
    saved.update(hidden_dropout=0.0, norm_epsilon=1e-6)  # the run keeps Megatron's default dropout, 0.1
    assert model_differences(saved, run) == [("--norm-epsilon", 1e-6, 1e-5), ("--hidden-dropout", 0.0, 0.1)]
    saved.pop("norm_epsilon")  # an older checkpoint is compared on what it records
    assert [d[0] for d in model_differences(saved, run)] == ["--hidden-dropout"]

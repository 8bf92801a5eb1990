"""Nothing silent on resume (issue 21): what --load may find, checkpoints of another model, ranks that would
read different iterations, --train-iters below the checkpoint, a changed LR schedule."""
import os

import pytest

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.resume import ResumePoint, resume_point
from engine.config import CheckpointConfig, Config, ConfigError
from engine.optim import build_optimizer
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.resolve import check_resumed
from harness import run_ranks


def gpt(layers=4, vocab=256) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, 32, 4, 16
    m.vocab_size, m.make_vocab_size_divisible_by = vocab, 16
    cfg.training.train_iters = 100
    return cfg


def built(cfg, ctx=None):
    ctx = ctx or ParallelContext.virtual()
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size)
    return chunks, build_optimizer(cfg, chunks, ctx), ctx


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-layer, 256-token GPT checkpoint at iteration 5."""
    root = str(tmp_path_factory.mktemp("resume") / "run")
    cfg = gpt()
    chunks, opt, ctx = built(cfg)
    save_checkpoint(root, 5, chunks, opt, ctx, cfg, {"consumed_samples": 40})
    return root


def _latest(d):
    from engine.checkpoint.files import read_latest
    return read_latest(d)


# ------------------------------------------------------------------ what --load finds

def test_a_load_directory_without_a_checkpoint_is_an_error_naming_what_was_expected(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"--load .*empty: no checkpoint there \(neither latest_checkpointed"):
        resume_point(CheckpointConfig(load=str(empty)), _latest)
    with pytest.raises(ConfigError, match="no checkpoint there"):
        resume_point(CheckpointConfig(load=str(empty), save=str(tmp_path / "elsewhere")), _latest)


def test_save_x_load_x_starts_fresh_once_and_says_so(tmp_path):
    point = resume_point(CheckpointConfig(load=str(tmp_path), save=str(tmp_path)), _latest)
    assert point.note.startswith(f"no checkpoint in --load {tmp_path} yet (it is also --save): starting from scratch")


def test_an_iteration_folder_loads_that_iteration(saved):
    point = resume_point(CheckpointConfig(load=os.path.join(saved, "iter_0000005")), _latest)
    assert point == ResumePoint(saved, 5)
    # a restarted job resumes its own --save before anything --load names
    assert resume_point(CheckpointConfig(load="/nonexistent", save=saved), _latest) == ResumePoint(saved)


def test_a_save_directory_without_latest_file_still_resumes_from_its_newest_folder(saved, tmp_path):
    import shutil
    copy = tmp_path / "nolatest"
    shutil.copytree(saved, copy)
    os.remove(copy / "latest_checkpointed_iteration.txt")
    assert resume_point(CheckpointConfig(save=str(copy)), _latest) == ResumePoint(str(copy))


# ------------------------------------------------------------------ a checkpoint of another model

@pytest.mark.parametrize("layers,vocab,expect", [
    (2, 256, r"was saved with --num-layers 4 \(this run: --num-layers 2\); train with the checkpoint's values$"),
    (6, 256, r"was saved with --num-layers 4 \(this run: --num-layers 6\)"),
    (300, 300, r"was saved with --vocab-size 256 \(this run: --vocab-size 300\)"),
    (250, 250, r"was saved with --vocab-size 256 \(this run: --vocab-size 250\)"),
    (200, 200, r"was saved with --vocab-size 256 \(this run: --vocab-size 200\)"),
])
def test_a_different_model_is_refused_naming_the_flags_and_both_values(saved, layers, vocab, expect):
    cfg = gpt(layers=4 if layers in (200, 250, 300) else layers, vocab=vocab)
    chunks, opt, ctx = built(cfg)
    with pytest.raises(ConfigError, match=expect) as err:
        load_checkpoint(saved, chunks, opt, ctx, model_cfg=cfg.model)
    text = str(err.value)
    assert "--ckpt-fallback" not in text and "\n" not in text and "tensor" not in text and "layers." not in text


def test_the_same_model_loads(saved):
    cfg = gpt()
    chunks, opt, ctx = built(cfg)
    extra = load_checkpoint(saved, chunks, opt, ctx, model_cfg=cfg.model)
    assert extra["iteration"] == 5 and extra["config"]["model"]["num_layers"] == 4


# ------------------------------------------------------------------ ranks agree

def _disagreeing_ranks(rank, world, roots):
    from engine.parallel.topology import build_context
    cfg = gpt()
    ctx = build_context(world, rank, 1, 1)
    chunks, opt, _ = built(cfg, ctx)
    try:
        load_checkpoint(roots[rank], chunks, opt, ctx, model_cfg=cfg.model)
    except ConfigError as e:
        return str(e)
    finally:
        ctx.destroy()
    return None


def test_ranks_that_see_different_iterations_stop_with_one_line_instead_of_mixing_weights(saved, tmp_path):
    import shutil
    other = tmp_path / "other"
    shutil.copytree(saved, other)
    os.rename(other / "iter_0000005", other / "iter_0000007")
    (other / "latest_checkpointed_iteration.txt").write_text("7\n")
    errors = run_ranks(_disagreeing_ranks, 2, [saved, str(other)], timeout=120)
    # (each rank names its own --load here only because the test gives them different paths)
    assert all("ranks see different checkpoints (rank 0: iteration 5, rank 1: iteration 7)" in e for e in errors)


def _rank_zeros_decision(rank, world, save):
    from engine.checkpoint.resume import resume_point
    sees = (lambda _d: 5) if rank == 0 else (lambda _d: None)  # only rank 0 sees the checkpoint being published
    return resume_point(CheckpointConfig(save=save), sees, rank)


def test_every_rank_takes_rank_zeros_resume_decision_even_when_it_sees_otherwise(tmp_path):
    points = run_ranks(_rank_zeros_decision, 2, str(tmp_path), timeout=120)
    assert points == [ResumePoint(str(tmp_path))] * 2


# ------------------------------------------------------------------ may the run go on from it

def test_train_iters_below_the_checkpoint_is_an_error_and_equal_says_nothing_is_left(saved):
    cfg = gpt()
    cfg.optim.lr_decay_iters = 100
    saved_cfg = {"optim": {"lr_decay_iters": 100}, "training": {"train_iters": 100}}
    cfg.training.train_iters = 3
    with pytest.raises(ConfigError, match="--train-iters 3: the checkpoint in .* is already at iteration 5; raise"):
        check_resumed(cfg, saved, 5, saved_cfg)
    lines = []
    cfg.training.train_iters = 5
    check_resumed(cfg, saved, 5, saved_cfg, lines.append)
    assert lines and "nothing left to train" in lines[0]


def test_a_changed_lr_schedule_is_refused_unless_overridden_or_taken_from_the_checkpoint():
    saved_cfg = {"optim": {"lr": 3e-4, "min_lr": 0.0, "lr_decay_style": "cosine", "lr_warmup_iters": 10,
                           "lr_decay_iters": None, "lr_wsd_decay_iters": None}, "training": {"train_iters": 100}}
    cfg = gpt()
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.lr_decay_style = 1e-3, 10, "cosine"
    with pytest.raises(ConfigError, match=r"LR schedule differs .*\(--lr 0\.0003 -> 0\.001\); .*"
                                          r"--override-opt-param-scheduler"):
        check_resumed(cfg, "ckpt", 5, saved_cfg)
    cfg.training.train_iters = 200  # a longer run changes the cosine's length too
    with pytest.raises(ConfigError, match=r"--lr-decay-iters \(default --train-iters\) 100 -> 200"):
        check_resumed(cfg, "ckpt", 5, saved_cfg)
    lines = []
    cfg.checkpoint.override_opt_param_scheduler = True
    check_resumed(cfg, "ckpt", 5, saved_cfg, lines.append)
    assert cfg.optim.lr == 1e-3 and "--override-opt-param-scheduler" in lines[0]
    cfg.checkpoint.override_opt_param_scheduler, cfg.checkpoint.use_checkpoint_opt_param_scheduler = False, True
    check_resumed(cfg, "ckpt", 5, saved_cfg, lines.append)
    assert (cfg.optim.lr, cfg.optim.lr_decay_iters) == (3e-4, 100) and "taken from the checkpoint" in lines[1]


def test_a_different_tokenizer_path_on_resume_is_said():
    cfg = gpt()
    cfg.optim.lr_decay_iters = 100
    cfg.data.tokenizer_model = "/data/new.model"
    saved_cfg = {"optim": {"lr_decay_iters": 100}, "data": {"tokenizer_model": "/data/old.model"}}
    lines = []
    check_resumed(cfg, "ckpt", 5, saved_cfg, lines.append)
    assert lines == ["note: the checkpoint was trained with --tokenizer-model /data/old.model; this run uses "
                     "/data/new.model (same vocabulary size, or loading would have failed): make sure it is the "
                     "same tokenizer"]

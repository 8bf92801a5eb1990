"""Resolution: the configuration meets the world. The flags describe a run; what they leave to be derived needs
the tokenizer's files, the world size, or the checkpoint the run resumes from.

- `resolve(cfg, world_size)`, once at start (the launcher, then the trainer: it is idempotent), fills in the
  vocabulary size, the end-of-document id, the global batch size and --train-samples as iterations, so that no
  other module derives them.
- `check_resumed(...)`, after a load, refuses what would silently go wrong: a model setting that differs from the
  checkpoint's and keeps every shape (`check_model`; --override-model-config or --finetune accept it and list
  it), a `--train-iters` at or below the checkpoint's iteration, and an LR schedule that differs from the one the
  checkpoint was trained with (unless `--override-opt-param-scheduler` keeps this run's or
  `--use-checkpoint-opt-param-scheduler` takes the checkpoint's, Megatron-LM's two flags, the latter by
  `adopt_schedule`, which rewrites cfg.optim). A checkpoint at iteration 0 has taken no step under its schedule,
  so its schedule is not compared (its model is). Where the run resumes from is
  engine/checkpoint/resume.py's choice.
"""
from __future__ import annotations

import os
from typing import Optional

from engine.config import Config, ConfigError, TrainingConfig
from engine.config.model_changes import listing, model_differences
from engine.data.build import document_flags, end_of_document
from engine.data.rampup import BatchSizeSchedule
from engine.data.tokenizer_spec import data_vocab_size
from engine.flags import flag_of
from engine.optim.schedule import SCHEDULE_FIELDS, decay_iters


def resolve(cfg: Config, world_size: int) -> Config:
    """Fill in, once, what the flags leave to be derived, so that no other module derives it again.

    The vocabulary size becomes the tokenizer's when a tokenizer reads real data, else --vocab-size, else
    256 (mock data); the end-of-document id is the tokenizer's when a flag reads document boundaries
    (engine/documents.py); the global batch size defaults to micro batch x dp; --train-samples sets
    --train-iters as Megatron-LM counts them. (The LR lengths in samples follow from these in engine.optim.schedule, at
    each step, so a schedule taken from a checkpoint on resume applies.) Idempotent; returns `cfg`.
    """
    m, tr = cfg.model, cfg.training
    if cfg.data.tokenizer_type == "NullTokenizer" and cfg.given_vocab_size is None:
        cfg.given_vocab_size = m.vocab_size  # its end-of-document id is added once (data_vocab_size)
    m.vocab_size = data_vocab_size(cfg)
    if document_flags(cfg.data) and not cfg.data.mock_data:
        cfg.eod_id = end_of_document(cfg)
    if tr.global_batch_size is None:
        tr.global_batch_size = tr.micro_batch_size * cfg.dp(world_size)
    if tr.train_samples is not None:
        tr.train_iters = _iterations_for_samples(tr)
    return cfg


def _iterations_for_samples(tr: TrainingConfig) -> int:
    """--train-samples as iterations, Megatron-LM's update_train_iters: whole global batches (a last partial
    one is dropped); under ramp-up the ramp's steps (see engine.data.rampup), then whole final batches."""
    if not tr.rampup_batch_size:
        return tr.train_samples // tr.global_batch_size
    return BatchSizeSchedule.from_config(tr).iterations_for(tr.train_samples)


def _saved_decay_iters(saved_cfg: dict) -> Optional[int]:
    saved_optim, saved_training = saved_cfg.get("optim") or {}, saved_cfg.get("training") or {}
    return decay_iters(saved_optim.get("lr_decay_iters"), saved_training.get("train_iters"))


def schedule_differences(saved_cfg: dict, cfg: Config) -> list:
    """(flag, checkpoint's value, this run's) for every LR-schedule setting that changed."""
    saved_optim, run_optim = saved_cfg.get("optim") or {}, cfg.optim
    out = [(flag_of(name), saved_optim[name], getattr(run_optim, name)) for name in SCHEDULE_FIELDS
           if name in saved_optim and saved_optim[name] != getattr(run_optim, name)]
    if run_optim.lr_decay_style != "constant":
        saved_len = _saved_decay_iters(saved_cfg)
        run_len = decay_iters(run_optim.lr_decay_iters, cfg.training.train_iters)
        if saved_len is not None and saved_len != run_len:
            out.append(("--lr-decay-iters (default --train-iters)", saved_len, run_len))
    return out


def adopt_schedule(saved_cfg: dict, cfg: Config) -> None:
    """Take the checkpoint's LR schedule (--use-checkpoint-opt-param-scheduler)."""
    saved_optim = saved_cfg.get("optim") or {}
    for name in SCHEDULE_FIELDS:
        if name in saved_optim:
            setattr(cfg.optim, name, saved_optim[name])
    cfg.optim.lr_decay_iters = _saved_decay_iters(saved_cfg)


def check_model(cfg: Config, directory: str, saved_cfg: dict, log=print, finetune: Optional[str] = None) -> None:
    """The model the checkpoint was trained as must be this run's: a setting that keeps every shape (the loader
    refused the others) is refused in one line naming the flags and both values, unless --override-model-config
    or --finetune says the change is meant; then it is listed."""
    changed = model_differences(saved_cfg.get("model") or {}, cfg.model)
    if not changed:
        return
    if cfg.checkpoint.override_model_config or finetune:
        why = "--override-model-config" if cfg.checkpoint.override_model_config else "--finetune"
        log(f"model settings changed from the checkpoint's in {directory} ({why}): {listing(changed)}")
        return
    raise ConfigError(f"the model differs from the one the checkpoint in {directory} was trained as: {listing(changed)}"
                      f"; resume with the checkpoint's values, or pass --override-model-config to train on with "
                      f"this run's")


def check_resumed(cfg: Config, directory: str, iteration: int, saved_cfg: dict, log=print,
                  finetune: Optional[str] = None) -> None:
    """After a load: the run must have iterations left and the LR schedule the checkpoint expects.
    `finetune`: the checkpoint whose weights alone were taken (ResumePoint.start), said in one line."""
    ck, train_iters = cfg.checkpoint, cfg.training.train_iters
    if train_iters < iteration:
        raise ConfigError(f"--train-iters {train_iters}: the checkpoint in {directory} is already at iteration "
                          f"{iteration}; raise --train-iters above {iteration} to train further")
    if train_iters == iteration:
        log(f"the checkpoint in {directory} is at iteration {iteration} = --train-iters: nothing left to train; "
            "raise --train-iters to continue")
    if finetune:
        log(f"--finetune: model weights from {finetune}; starting at iteration 0 with a fresh optimizer and data "
            "position")
    saved_tokenizer = (saved_cfg.get("data") or {}).get("tokenizer_model")
    if saved_tokenizer and cfg.data.tokenizer_model and \
            os.path.abspath(saved_tokenizer) != os.path.abspath(cfg.data.tokenizer_model):
        log(f"note: the checkpoint was trained with --tokenizer-model {saved_tokenizer}; this run uses "
            f"{cfg.data.tokenizer_model} (same vocabulary size, or loading would have failed): make sure it is the "
            "same tokenizer")
    check_model(cfg, directory, saved_cfg, log, finetune)
    changed = schedule_differences(saved_cfg, cfg) if iteration > 0 else []
    if not changed:
        return
    listing = ", ".join(f"{flag} {old} -> {new}" for flag, old, new in changed)
    if ck.use_checkpoint_opt_param_scheduler:
        adopt_schedule(saved_cfg, cfg)
        log(f"LR schedule taken from the checkpoint (--use-checkpoint-opt-param-scheduler): {listing} undone")
    elif ck.override_opt_param_scheduler:
        log(f"LR schedule changed on resume (--override-opt-param-scheduler): {listing}")
    else:
        raise ConfigError(f"the LR schedule differs from the checkpoint's in {directory} ({listing}); resume with "
                          "the same settings, or pass --override-opt-param-scheduler to use this run's or "
                          "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")

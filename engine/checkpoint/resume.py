"""Where a run resumes from, and whether it may: decided once, by rank 0, for every rank.

- A `--save` directory that holds a checkpoint is a restarted job: it resumes its own run.
- Otherwise `--load`: a run's `--save` directory (its latest iteration) or one of its `iter_NNNNNNN`
  folders (that iteration).
- Else `--pretrained-checkpoint` (Megatron's: a checkpoint to start from when --load has none).
- A `--load` that holds nothing is an error naming what was expected there, except when it is also
  `--save` (Megatron's `--save X --load X` idiom for a job that resumes itself): the first run starts
  from scratch and says so.

`--finetune` (and any start from `--pretrained-checkpoint`) takes only the model weights: the run starts at
iteration 0 with a fresh optimizer and data position (`ResumePoint.start`). It never applies to the run's own
`--save`, so a restarted fine-tuning job resumes where it stopped.

After the load, `check_resumed` refuses what would silently go wrong: a `--train-iters` at or below the
checkpoint's iteration, and an LR schedule that differs from the one the checkpoint was trained with
(unless `--override-opt-param-scheduler` keeps this run's or `--use-checkpoint-opt-param-scheduler`
takes the checkpoint's, Megatron-LM's two flags). A checkpoint at iteration 0 has taken no step under its
schedule, so it is not compared.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from engine.checkpoint import files
from engine.config import ConfigError
from engine.parallel.comm import all_gather_object

_ITER_FOLDER = re.compile(r"^iter_(\d{7})$")

# The settings that shape the LR curve, as (config field, flag). The decay length defaults to --train-iters.
SCHEDULE_FIELDS = tuple((name, "--" + name.replace("_", "-")) for name in (
    "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_wsd_decay_iters", "lr_wsd_decay_style",
    "lr_warmup_fraction", "lr_warmup_init", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples"))


@dataclass(frozen=True)
class ResumePoint:
    directory: str
    iteration: Optional[int] = None  # None: the directory's latest
    note: Optional[str] = None       # a line to print (rank 0) about the choice
    finetune: bool = False           # the model weights only: iteration 0, fresh optimizer and data

    def start(self, extra: Optional[dict]) -> Optional[dict]:
        """The loaded state the run continues from: as saved, or with --finetune iteration 0 and fresh data."""
        if extra is None or not self.finetune:
            return extra
        return {"iteration": 0, "consumed_samples": 0, "config": extra["config"], "finetune": self.directory}


def has_checkpoint(directory: str, latest: Callable) -> bool:
    return latest(directory) is not None or bool(files.list_iterations(directory))


def _point_in(path: str, latest: Callable, finetune: bool) -> Optional[ResumePoint]:
    """A run's --save directory (its latest iteration) or one of its iter_NNNNNNN folders; None if it holds none."""
    path = os.path.normpath(path)
    match = _ITER_FOLDER.match(os.path.basename(path))
    if match and os.path.isdir(path):
        return ResumePoint(os.path.dirname(path) or ".", int(match.group(1)), finetune=finetune)
    return ResumePoint(path, finetune=finetune) if has_checkpoint(path, latest) else None


def _decide(ck, latest: Callable):
    """ResumePoint, None (start from scratch) or a ConfigError message."""
    if ck.save and os.path.isdir(ck.save) and has_checkpoint(ck.save, latest):
        return ResumePoint(ck.save)
    point = _point_in(ck.load, latest, ck.finetune) if ck.load else None
    if point is None and ck.pretrained_checkpoint:
        point = _point_in(ck.pretrained_checkpoint, latest, True)
        if point is None:
            return (f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no checkpoint there; give a directory made "
                    "by tools/convert_hf.py or a run's --save")
    if point is not None or not ck.load:
        return point
    load = os.path.normpath(ck.load)
    if ck.save and os.path.abspath(load) == os.path.abspath(ck.save):
        return ResumePoint(load, None, f"no checkpoint in --load {ck.load} yet (it is also --save): starting from "
                                       "scratch; a restart of this job will resume from there")
    return (f"--load {ck.load}: no checkpoint there (neither {files.LATEST_FILE} nor iter_NNNNNNN folders); give the "
            f"--save directory of a run or one of its iter_NNNNNNN folders, or drop --load to start from scratch")


def resume_point(ck, latest: Callable, rank: int = 0) -> Optional[ResumePoint]:
    """Collective: rank 0 decides and every rank gets its answer, or the same ConfigError everywhere.

    Returns None to start from scratch (a ResumePoint carrying only a note also means that)."""
    decision = _decide(ck, latest) if rank == 0 else None
    decision = all_gather_object(decision)[0]
    if isinstance(decision, str):
        raise ConfigError(decision)
    return decision


def _decay_iters(optim: dict, train_iters) -> Optional[int]:
    return optim.get("lr_decay_iters") or train_iters


def schedule_differences(saved_cfg: dict, cfg) -> list:
    """(flag, checkpoint's value, this run's) for every LR-schedule setting that changed."""
    saved_optim, run_optim = saved_cfg.get("optim") or {}, cfg.optim
    out = [(flag, saved_optim[name], getattr(run_optim, name)) for name, flag in SCHEDULE_FIELDS
           if name in saved_optim and saved_optim[name] != getattr(run_optim, name)]
    if run_optim.lr_decay_style != "constant":
        saved_len = _decay_iters(saved_optim, (saved_cfg.get("training") or {}).get("train_iters"))
        run_len = run_optim.lr_decay_iters or cfg.training.train_iters
        if saved_len is not None and saved_len != run_len:
            out.append(("--lr-decay-iters (default --train-iters)", saved_len, run_len))
    return out


def adopt_schedule(saved_cfg: dict, cfg) -> None:
    """Take the checkpoint's LR schedule (--use-checkpoint-opt-param-scheduler)."""
    saved_optim = saved_cfg.get("optim") or {}
    for name, _ in SCHEDULE_FIELDS:
        if name in saved_optim:
            setattr(cfg.optim, name, saved_optim[name])
    cfg.optim.lr_decay_iters = _decay_iters(saved_optim, (saved_cfg.get("training") or {}).get("train_iters"))


def check_resumed(cfg, directory: str, iteration: int, saved_cfg: dict, log=print,
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

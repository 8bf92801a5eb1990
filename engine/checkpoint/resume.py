"""Where a run resumes from, and whether it may: decided once, by rank 0, for every rank.

- A `--save` directory that holds a checkpoint is a restarted job: it resumes its own run.
- Otherwise `--load`: a run's `--save` directory (its latest iteration) or one of its `iter_NNNNNNN`
  folders (that iteration), or a Megatron-LM save (found by its files), which rank 0 converts first
  (engine/checkpoint/megatron/run_import.py) while the other ranks wait for this decision.
- Else `--pretrained-checkpoint` (Megatron's: a checkpoint to start from when --load has none).
- A `--load` that holds nothing is an error naming what was expected there, except when it is also
  `--save` (Megatron's `--save X --load X` idiom for a job that resumes itself): the first run starts
  from scratch and says so.

`--finetune` (and any start from `--pretrained-checkpoint`) takes only the model weights: the run starts at
iteration 0 with a fresh optimizer and data position (`ResumePoint.start`). It never applies to the run's own
`--save`, so a restarted fine-tuning job resumes where it stopped.

Whether the run may continue from what was loaded (iterations left, the LR schedule) is checked against the
config by engine.resolve.check_resumed.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from engine.checkpoint import files
from engine.checkpoint.megatron.run_import import convert_for_run
from engine.checkpoint.megatron.source import megatron_format
from engine.config import ConfigError
from engine.parallel.comm import all_gather_object

_ITER_FOLDER = re.compile(r"^iter_(\d{7})$")


@dataclass(frozen=True)
class ResumePoint:
    directory: str
    iteration: Optional[int] = None  # None: the directory's latest
    note: Optional[str] = None       # a line to print (rank 0) about the choice
    finetune: bool = False           # the model weights only: iteration 0, fresh optimizer and data
    told: tuple = ()                 # lines to print (rank 0) when the run resumes from here

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


def _megatron(ck):
    """The ResumePoint of a Megatron-LM save given as --load, converted (or a ConfigError message)."""
    try:
        directory, lines = convert_for_run(ck.load, ck.save)
    except ConfigError as e:
        return str(e)
    return ResumePoint(directory, finetune=ck.finetune, told=tuple(lines))


def _decide(ck, latest: Callable):
    """ResumePoint, None (start from scratch) or a ConfigError message."""
    if ck.save and megatron_format(ck.save):
        return (f"--save {ck.save}: holds a Megatron-LM checkpoint; give this run a --save of its own (--load "
                f"{ck.save} converts and resumes that checkpoint)")
    if ck.save and os.path.isdir(ck.save) and has_checkpoint(ck.save, latest):
        return ResumePoint(ck.save)
    if ck.load and megatron_format(ck.load):
        return _megatron(ck)
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

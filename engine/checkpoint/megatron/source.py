"""A Megatron-LM save directory: which format it is, which iteration to read, and that iteration opened.

    <save>/latest_checkpointed_iteration.txt      the iteration (or "release")
    <save>/iter_0000100/                          torch_dist: metadata.json, common.pt, .metadata, __R_T.distcp
                                                  torch (legacy): mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/release/                               a released model (iteration 0)

`megatron_format(path)` tells a Megatron save (or one of its iteration folders) from anything else by those
files, and from a Ternion checkpoint, whose iteration folders hold Ternion's own metadata.json. `open_megatron`
opens the iteration and gives a `MegatronCheckpoint`: the `args` Namespace, the iteration, and a tensor source
(torch_dist.TorchDist or legacy.Legacy) with the same `shapes` / `read` whatever the format.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from engine.checkpoint import files
from engine.checkpoint.megatron.legacy import Legacy, is_legacy
from engine.checkpoint.megatron.tables import stored_names
from engine.checkpoint.megatron.marks import is_torch_dist
from engine.config import ConfigError

RELEASE = "release"
_ITER = re.compile(r"^iter_(\d{7})$")


def _iteration_folder_format(path: str) -> Optional[str]:
    if is_torch_dist(path):
        return "torch_dist"
    return "torch" if is_legacy(path) else None


def _folders(save: str) -> list:
    """(iteration, folder) of a save directory, ascending; the release folder counts as iteration 0."""
    out = [(int(m.group(1)), os.path.join(save, d)) for d in os.listdir(save) if (m := _ITER.match(d))]
    if os.path.isdir(os.path.join(save, RELEASE)):
        out.append((0, os.path.join(save, RELEASE)))
    return sorted(out)


def megatron_format(path: str) -> Optional[str]:
    """"torch_dist" or "torch" when `path` is a Megatron-LM save directory or iteration folder, else None."""
    if not os.path.isdir(path):
        return None
    own = _iteration_folder_format(path)
    if own is not None:
        return own
    found = [f for _, folder in _folders(path) if (f := _iteration_folder_format(folder))]
    return found[-1] if found else None


def resolve_iteration(path: str, iteration: Optional[int] = None) -> tuple:
    """(iteration, folder) to read: the folder given, `iteration`, else what latest_checkpointed_iteration.txt
    names (Megatron's "release" included)."""
    if _iteration_folder_format(path) is not None:
        match = _ITER.match(os.path.basename(os.path.normpath(path)))
        return (int(match.group(1)) if match else 0), path
    saved = _folders(path)
    have = f"saved iterations: {', '.join(str(i) for i, _ in saved)}"
    if iteration is not None:
        folder = os.path.join(path, files.iter_dir_name(iteration))
        if not os.path.isdir(folder):
            raise ConfigError(f"--iteration {iteration}: {folder} not found; {have}")
        return iteration, folder
    latest = os.path.join(path, files.LATEST_FILE)
    text = open(latest).read().strip() if os.path.isfile(latest) else None
    if text == RELEASE:
        return 0, os.path.join(path, RELEASE)
    if text is None or not text.isdigit():
        raise ConfigError(f"--load {path}: {files.LATEST_FILE} is missing or unreadable; {have}; pass --iteration N")
    folder = os.path.join(path, files.iter_dir_name(int(text)))
    if not os.path.isdir(folder):
        raise ConfigError(f"--load {path}: {files.LATEST_FILE} names iteration {text} but {folder} is missing; {have}")
    return int(text), folder


@dataclass
class MegatronCheckpoint:
    path: str        # the iteration folder
    format: str      # "torch_dist" or "torch"
    iteration: int
    common: dict     # what is not a sharded tensor: args, iteration, opt_param_scheduler, optimizer, ...
    tensors: object  # TorchDist or Legacy

    @property
    def args(self):
        return self.common.get("args")

    def locate(self, names: tuple) -> Optional[tuple]:
        """(stored key, leading indices) of the first of `names` the checkpoint holds, or None."""
        for name in names:
            for key, lead in stored_names(name):
                if key in self.tensors.shapes and len(self.tensors.shapes[key]) > len(lead):
                    return key, lead
        return None

    def shape(self, where: tuple) -> tuple:
        key, lead = where
        return self.tensors.shapes[key][len(lead):]

    def read(self, where: tuple):
        return self.tensors.read(*where)


def open_megatron(path: str, iteration: Optional[int] = None) -> MegatronCheckpoint:
    """Open iteration `iteration` (default: the latest) of a Megatron-LM save directory, or the folder given."""
    if not os.path.isdir(path):
        raise ConfigError(f"--load {path}: directory not found")
    if megatron_format(path) is None:
        raise ConfigError(f"--load {path}: not a Megatron-LM checkpoint (no iter_NNNNNNN folder with metadata.json + "
                          "common.pt (torch_dist) or mp_rank_XX/ (torch))")
    it, folder = resolve_iteration(path, iteration)
    fmt = _iteration_folder_format(folder)
    if fmt is None:
        raise ConfigError(f"{folder}: neither torch_dist (metadata.json, common.pt, .metadata) nor torch "
                          "(mp_rank_XX/model_optim_rng.pt) files; the save did not finish or was not copied whole")
    if fmt == "torch_dist":
        from engine.checkpoint.megatron.torch_dist import TorchDist  # torch.distributed.checkpoint: only when read
        tensors = TorchDist(folder)
    else:
        tensors = Legacy(folder)
    common = tensors.common
    if common.get("args") is None:
        raise ConfigError(f"{folder}: its common state holds no args (saved with --no-save-args?); they say what "
                          "model it is")
    return MegatronCheckpoint(folder, fmt, int(common.get("iteration", it) or it), common, tensors)

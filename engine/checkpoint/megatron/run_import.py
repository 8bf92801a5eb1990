"""`launch/pretrain_gpt.py --load MEGATRON_SAVE`: the Megatron-LM save converted where the run can load it.

The run's rank 0 converts it (importer.import_megatron, what tools/convert_megatron.py does) while the other
ranks wait for the resume decision (engine/checkpoint/resume.py), and every rank then loads the result like
any Ternion checkpoint, at the run's own layout. Where: `<--save>/megatron_import/`, so a restart of the job
before its first save reuses the conversion instead of repeating it (and one after it resumes from its own
save, as any run does); without --save, a temporary folder removed when rank 0 exits. A conversion of another
source or iteration found there is replaced.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Optional

from engine.checkpoint import files
from engine.checkpoint.megatron.importer import import_megatron
from engine.checkpoint.megatron.source import resolve_iteration
from engine.checkpoint.reader import CheckpointReader
from engine.config import ConfigError

FOLDER = "megatron_import"


def _previous(folder: str, source: str) -> Optional[int]:
    """The iteration of an earlier conversion of the Megatron iteration folder `source` in `folder`, or None."""
    latest = files.read_latest(folder) if os.path.isdir(folder) else None
    if latest is None:
        return None
    try:
        extra = CheckpointReader(os.path.join(folder, files.iter_dir_name(latest))).meta.extra_state
    except ConfigError:  # a damaged earlier conversion is simply redone
        return None
    return latest if (extra.get("megatron") or {}).get("source") == os.path.abspath(source) else None


def convert_for_run(load: str, save: Optional[str]) -> tuple:
    """(the Ternion checkpoint directory to load, the lines to print) for the Megatron-LM save `load`."""
    if save:
        folder = os.path.join(save, FOLDER)
        done = _previous(folder, resolve_iteration(load)[1])
        if done is not None:
            return folder, [f"note: --load {load} is a Megatron-LM checkpoint, converted earlier into {folder} "
                            f"(iteration {done}): loading that"]
        shutil.rmtree(folder, ignore_errors=True)
    else:
        folder = tempfile.mkdtemp(prefix="ternion-megatron-")
        atexit.register(shutil.rmtree, folder, True)
        os.rmdir(folder)
    _, ck, notes = import_megatron(load, folder)
    return folder, [f"note: --load {load} is a Megatron-LM {ck.format} checkpoint (iteration {ck.iteration}): "
                    f"converted into {folder} (as tools/convert_megatron.py does), loaded from there"] + notes

"""The files that mark a Megatron-LM torch_dist iteration folder, and the test for them.

Kept apart from torch_dist.py (the reader) so that telling formats apart, which every `--load` does, does not
import torch.distributed.checkpoint: about a second of every training process's start-up.
"""
from __future__ import annotations

import json
import os

BACKEND_FILE, COMMON_FILE, DCP_METADATA = "metadata.json", "common.pt", ".metadata"


def is_torch_dist(path: str) -> bool:
    """Megatron's mark of a torch_dist folder: metadata.json naming the sharded backend."""
    try:
        with open(os.path.join(path, BACKEND_FILE)) as fh:
            return "sharded_backend" in json.load(fh)
    except (OSError, ValueError, TypeError):
        return False

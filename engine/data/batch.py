"""Turning global sample indices into the tensors a training step consumes."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def make_batch(dataset, indices: Sequence[int], device: Optional[torch.device] = None) -> dict:
    """{"tokens", "labels": LongTensor[b, s], "loss_mask": FloatTensor[b, s]} for samples `indices`.

    Each sample holds s + 1 tokens: the inputs are the first s, the labels the last s (shifted by one).
    """
    samples = np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices])
    data = torch.from_numpy(samples)
    batch = {
        "tokens": data[:, :-1].contiguous(),
        "labels": data[:, 1:].contiguous(),
        "loss_mask": torch.ones(data.shape[0], data.shape[1] - 1, dtype=torch.float32),
    }
    if device is not None:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch


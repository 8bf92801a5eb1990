"""Turning global sample indices into the tensors a training step consumes."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def make_batch(dataset, indices: Sequence[int], device: Optional[torch.device] = None) -> dict:
    """{"tokens", "labels": LongTensor[b, s], "loss_mask": FloatTensor[b, s]} for samples `indices`.

    Each sample holds s + 1 tokens: the inputs are the first s, the labels the last s (shifted by one).
    A dataset with an `eod_mask` id (--eod-mask-loss) gets no loss where the input is that id, i.e. on the
    first token of the next document (Megatron-LM's rule).
    """
    samples = np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices])
    data = torch.from_numpy(samples)
    batch = {
        "tokens": data[:, :-1].contiguous(),
        "labels": data[:, 1:].contiguous(),
        "loss_mask": torch.ones(data.shape[0], data.shape[1] - 1, dtype=torch.float32),
    }
    eod = getattr(dataset, "eod_mask", None)
    if eod is not None:
        batch["loss_mask"][batch["tokens"] == eod] = 0.0
    if device is not None:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch


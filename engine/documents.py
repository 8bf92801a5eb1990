"""Packed documents: which document each token of a packed sample belongs to, read from its end-of-document tokens.

A packed sample (engine/data/gpt_dataset.py) is documents laid end to end, each ended by the tokenizer's EOD id
when the data was made with tools/preprocess_data.py --append-eod. The boundaries are read off the input tokens
as Megatron-LM's get_ltor_masks_and_position_ids reads them: an EOD token ends its own document and the token
after it starts the next. Two flags use them:
- --reset-attention-mask: a token attends only to the tokens of its own document (engine/attention_mask.py);
- --reset-position-ids: positions restart at 0 with each document (the RoPE angles, the learned position table);
and --eod-mask-loss drops the loss where the input is EOD (engine/data/batch.py): the first token of a document
is not predicted from the document before it.

`Packing` is the run's rule, built once (`of`); at the pipeline runner's door (engine/parallel/context_split.
shard_batch) it reads a microbatch of whole sequences, before the sequence is cut for context parallelism (a
document may cross a CP rank's chunks), and gives each sample's position ids [b, s] and the `Documents`.

`Documents` holds, for every position, the first and the last position of its document: `bounds` [2, b, s]
int32 on the tokens' device, for the kernels, which index it by absolute position (so a context-parallel block
reads the rows it holds), and the same on the host for what is decided there: which blocks of the ring hold a
visible pair (engine/attention_mask.py) and the documents' lengths the FLOP count reads (engine/flops.py). One
value per microbatch, hashed by identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def document_bounds(tokens: torch.Tensor, eod: int) -> tuple:
    """(first, last) [b, s] int64: the first and the last position of each position's document, where a document
    ends at an EOD token (inclusive) or at the end of the sample."""
    b, s = tokens.shape
    index = torch.arange(s, device=tokens.device).expand(b, s)
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, index, 0).cummax(dim=1).values
    last = torch.where(ends, index, s).flip(1).cummin(dim=1).values.flip(1)
    return first, last


class Documents:
    """A microbatch's documents: `bounds` [2, b, s] int32 (first and last position of each position's document) on
    the tokens' device, and `first`, `last` [b, s] on the host."""

    def __init__(self, first: torch.Tensor, last: torch.Tensor):
        self.bounds = torch.stack((first, last)).to(torch.int32).contiguous()
        self.first, self.last = self.bounds.cpu().numpy().astype(np.int64)
        self.plans: dict = {}  # the context-parallel ring's plans for these documents (ring_attention.plan)

    @property
    def samples(self) -> int:
        return self.first.shape[0]

    def lengths(self) -> list:
        """Each sample's document lengths in order (a document cut by the sample's ends counts what is in it)."""
        s = self.first.shape[1]
        return [np.diff(np.append(np.flatnonzero(row == np.arange(s)), s)).tolist() for row in self.first]


@dataclass(frozen=True)
class Packing:
    """The run's rule for packed samples: the EOD id and which of Megatron-LM's two resets it asks for."""
    eod: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def of(cls, cfg) -> "Packing":
        """The rule of a resolved Config (engine/resolve.py fills in the tokenizer's EOD id when a flag reads it)."""
        return cls(cfg.eod_id, cfg.data.reset_position_ids, cfg.data.reset_attention_mask)

    def apply(self, tokens: torch.Tensor) -> tuple:
        """(position ids [b, s] or None, Documents or None) of a microbatch's whole-sequence tokens [b, s]: None
        where the run does not reset them (positions run over the whole sample; attention crosses documents)."""
        if not (self.reset_position_ids or self.reset_attention_mask):
            return None, None
        first, last = document_bounds(tokens, self.eod)
        ids = torch.arange(tokens.shape[1], device=tokens.device) - first if self.reset_position_ids else None
        return ids, Documents(first, last) if self.reset_attention_mask else None

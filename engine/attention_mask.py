"""Attention semantics as one value: which keys each query may see.

`AttentionMask` is built once from the model config (`of`) and handed to the one attention entry point
(engine.parallel.attention: local kernels, the context-parallel ring or all-gather, one signature), and the
FLOP and memory formulas read the same value (`keys_per_query`), so a new kind of mask is written down here
and taught to the kernels, not re-decided at every site. Today every decoder is causal; sliding windows
and per-document boundaries (packed sequences) are the next semantics to join it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionMask:
    causal: bool = True  # each query sees its own position and every earlier one

    @classmethod
    def of(cls, model) -> "AttentionMask":
        """The mask of a ModelConfig's decoder layers."""
        return cls()

    def keys_per_query(self, seq_length: int) -> int:
        """Keys each query is counted against by the FLOP and activation formulas. The convention of the
        published figures Ternion is checked against (Narayanan et al. 2021, PaLM's MFU) counts the whole
        s x s score matrix even for a causal mask, so this is the sequence length."""
        return seq_length

"""Attention semantics as one value: which keys each query may see, decided from absolute positions.

`AttentionMask` is built per layer from the model config (`of`) and handed to the one attention entry point
(engine.parallel.attention: local kernels, the context-parallel ring or all-gather, one signature). The rule is
written on positions, not on tensor indices: a query at position i sees the key at position j iff

    j <= i            (causal)
    i - j <= window   (a sliding window of `window` keys before the query, when set)
    first(i) <= j <= last(i)   (packed documents, --reset-attention-mask: the query's own document only)

so a kernel, or the ring deciding which of its blocks to compute, asks the same question of any two ranges of
positions (`sees_any`, `sees_all`, `pairs`), wherever the sequence was cut. The first two conditions are the
layer's (`of`); the documents are the microbatch's (engine/documents.py: first and last position of each
position's document, per sample), joined to the layer's mask on the way in (`within`), so the one attention
entry point takes one value whatever the path. Every condition bounds the keys a query sees to one interval
of positions, so each question is a question about intervals (`_spans`), per sample where documents differ.

The window is Megatron-LM's left bound L of `--window-size L,0` (engine/config/model.py): the query itself and
the L keys before it, L + 1 positions in all; transformers' `sliding_window` W counts the query, so it is W - 1.

FLOP convention (`counted_pairs`, read by engine/flops.py and the planner): the published figures Ternion is
checked against (Narayanan et al. 2021, PaLM's MFU) count every query against the whole sequence even under a
causal mask, i.e. the span a query is allowed, not the triangle cut at the start of the sequence. A window
counts the same way: each query against the L + 1 keys of its window (at most the sequence), so a window at
least the sequence long counts exactly as full attention and a 1024-token window on 8192 tokens is 1/8 of it.
Packed documents count each query against its whole document, or its window where shorter: sum L_i^2 over
the documents rather than s^2, the squares the kernels keep when they skip the rest. Megatron-LM's count
(training.py num_floating_point_operations) halves the causal square and does not read the window at all; the
context-parallel FLOP counter (engine/parallel/ring_attention.py) counts the pairs actually computed, `pairs`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from engine.documents import Documents

UNBOUNDED = 1 << 62  # a distance bound no sequence reaches: the side of the rule that does not apply


@dataclass(frozen=True)
class AttentionMask:
    causal: bool = True            # each query sees its own position and none after it
    window: Optional[int] = None   # L: keys at most L positions before the query (None: every earlier key)
    documents: Optional[Documents] = None  # the microbatch's packed documents (None: the sample is one sequence)

    @classmethod
    def of(cls, model, layer: int) -> "AttentionMask":
        """The mask of decoder layer `layer` (global id) of a ModelConfig: --window-attn-skip-freq gives some
        layers the window and others full attention."""
        return cls(window=model.attention_window(layer))

    def within(self, documents: Optional[Documents]) -> "AttentionMask":
        """This layer's mask for one microbatch: keys of the query's own document only, when it packs documents."""
        return self if documents is None else dataclasses.replace(self, documents=documents)

    @property
    def bounds(self):
        """The documents' [2, b, s] int32 bounds the kernels read (None: no document rule)."""
        return None if self.documents is None else self.documents.bounds

    def distances(self) -> tuple:
        """(least, greatest) query position minus key position a query sees."""
        return (0 if self.causal else -UNBOUNDED), (self.window if self.window is not None else UNBOUNDED)

    def _spans(self, queries: range) -> tuple:
        """(lo, hi) [samples, len(queries)]: the interval of key positions each query sees (one row for every
        sample without documents)."""
        least, greatest = self.distances()
        i = np.arange(queries[0], queries[-1] + 1, dtype=np.int64)[None, :]
        lo, hi = i - greatest, i - least
        if self.documents is not None:
            at = slice(queries[0], queries[-1] + 1)
            lo, hi = np.maximum(lo, self.documents.first[:, at]), np.minimum(hi, self.documents.last[:, at])
        return lo, hi

    def sees_any(self, queries: range, keys: range) -> bool:
        """Whether some query at `queries` sees some key at `keys` (ranges of absolute positions) in some sample."""
        lo, hi = self._spans(queries)
        return bool((np.maximum(lo, keys[0]) <= np.minimum(hi, keys[-1])).any())

    def sees_all(self, queries: range, keys: range) -> bool:
        """Whether every query at `queries` sees every key at `keys`, in every sample: a block that needs no mask."""
        lo, hi = self._spans(queries)
        return bool(((lo <= keys[0]) & (hi >= keys[-1])).all())

    def pairs(self, queries: range, keys: range, samples: int = 1) -> int:
        """How many (query, key) pairs of the two ranges are visible in `samples` samples (each its own documents
        when set): the work a kernel that skips the rest does."""
        lo, hi = self._spans(queries)
        seen = int(np.clip(np.minimum(hi, keys[-1]) - np.maximum(lo, keys[0]) + 1, 0, None).sum())
        return seen if self.documents is not None else seen * samples

    def counted_pairs(self, lengths: Sequence[int]) -> int:
        """Query-key pairs the FLOP and activation formulas count for one sample whose documents have these lengths
        (the module's convention): each query against its whole document, or the window's L + 1 positions where
        that is shorter."""
        return sum(n * (n if self.window is None else min(n, self.window + 1)) for n in lengths)

    def keys_per_query(self, seq_length: int) -> int:
        """Keys each query of an unpacked sample is counted against: the sequence length, or the window's L + 1
        positions where that is shorter."""
        return self.counted_pairs([seq_length]) // seq_length


def mean_keys_per_query(model, seq_length: int, document_length: Optional[int] = None) -> float:
    """Keys per query averaged over the model's layers, whose masks differ under --window-attn-skip-freq: the
    per-layer figure of formulas that count one average layer times the layer count. `document_length`: samples
    packed with documents of this length (the last one cut by the sample's end), under --reset-attention-mask."""
    lengths = packed_lengths(seq_length, document_length)
    layers = range(model.num_layers)
    return sum(AttentionMask.of(model, i).counted_pairs(lengths) for i in layers) / model.num_layers / seq_length


def packed_lengths(seq_length: int, document_length: Optional[int] = None) -> list:
    """The document lengths of a sample of `seq_length` tokens packed with documents of `document_length` (the
    last one what is left), or the one whole sequence."""
    if not document_length or document_length >= seq_length:
        return [seq_length]
    whole, rest = divmod(seq_length, document_length)
    return [document_length] * whole + ([rest] if rest else [])

"""Attention semantics as one value: which keys each query may see, decided from absolute positions.

`AttentionMask` is built per layer from the model config (`of`) and handed to the one attention entry point
(engine.parallel.attention: local kernels, the context-parallel ring or all-gather, one signature). The rule is
written on positions, not on tensor indices: a query at position i sees the key at position j iff

    j <= i            (causal)
    i - j <= window   (a sliding window of `window` keys before the query, when set)

so a kernel, or the ring deciding which of its blocks to compute, asks the same question of any two ranges of
positions (`sees_any`, `sees_all`, `pairs`), wherever the sequence was cut. A per-document rule (packed
sequences: keys of the query's own document only) joins as one more condition on the same positions.

The window is Megatron-LM's left bound L of `--window-size L,0` (engine/config/model.py): the query itself and
the L keys before it, L + 1 positions in all; transformers' `sliding_window` W counts the query, so it is W - 1.

FLOP convention (`keys_per_query`, read by engine/flops.py and the planner): the published figures Ternion is
checked against (Narayanan et al. 2021, PaLM's MFU) count every query against the whole sequence even under a
causal mask, i.e. the span a query is allowed, not the triangle cut at the start of the sequence. A window
counts the same way: each query against the L + 1 keys of its window (at most the sequence), so a window at
least the sequence long counts exactly as full attention and a 1024-token window on 8192 tokens is 1/8 of it.
Megatron-LM's count (training.py num_floating_point_operations) halves the causal square and does not read
the window at all; the context-parallel FLOP counter (engine/parallel/ring_attention.py) counts the pairs
actually computed, `pairs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

UNBOUNDED = 1 << 62  # a distance bound no sequence reaches: the side of the rule that does not apply


@dataclass(frozen=True)
class AttentionMask:
    causal: bool = True            # each query sees its own position and none after it
    window: Optional[int] = None   # L: keys at most L positions before the query (None: every earlier key)

    @classmethod
    def of(cls, model, layer: int) -> "AttentionMask":
        """The mask of decoder layer `layer` (global id) of a ModelConfig: --window-attn-skip-freq gives some
        layers the window and others full attention."""
        return cls(window=model.attention_window(layer))

    def distances(self) -> tuple:
        """(least, greatest) query position minus key position a query sees."""
        return (0 if self.causal else -UNBOUNDED), (self.window if self.window is not None else UNBOUNDED)

    def sees_any(self, queries: range, keys: range) -> bool:
        """Whether some query at `queries` sees some key at `keys` (ranges of absolute positions): the distances
        between the two ranges are one run of integers, so it is whether that run meets the allowed one."""
        least, greatest = self.distances()
        return queries[-1] - keys[0] >= least and queries[0] - keys[-1] <= greatest

    def sees_all(self, queries: range, keys: range) -> bool:
        """Whether every query at `queries` sees every key at `keys`: a block that needs no mask."""
        least, greatest = self.distances()
        return queries[0] - keys[-1] >= least and queries[-1] - keys[0] <= greatest

    def pairs(self, queries: range, keys: range) -> int:
        """How many (query, key) pairs of the two ranges are visible: the work a kernel that skips the rest does."""
        least, greatest = self.distances()
        total = 0
        for i in queries:
            total += max(0, min(keys[-1], i - least) - max(keys[0], i - greatest) + 1)
        return total

    def keys_per_query(self, seq_length: int) -> int:
        """Keys each query is counted against by the FLOP and activation formulas (the module's convention):
        the sequence length, or the window's L + 1 positions where that is shorter."""
        return seq_length if self.window is None else min(seq_length, self.window + 1)


def mean_keys_per_query(model, seq_length: int) -> float:
    """`keys_per_query` averaged over the model's layers, whose masks differ under --window-attn-skip-freq: the
    per-layer figure of formulas that count one average layer times the layer count."""
    layers = range(model.num_layers)
    return sum(AttentionMask.of(model, i).keys_per_query(seq_length) for i in layers) / model.num_layers

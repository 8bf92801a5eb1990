"""Weighted blends of datasets, in Megatron-LM's order, with phases that change the weights at given samples.

The interleave is megatron-core's BlendedDataset's, sample for sample: at each position it takes the
source whose count lags its share the most -- the largest weight x max(position, 1) - samples taken
so far, the lower source id on ties -- computed in the same float64 arithmetic, so the sequence is
identical. Every prefix holds each source within a sample or two of its share. The sizes are
Megatron's too (`blend_sizes`): a blend asked for n samples holds sum(ceil(n x w_i)) of them, and
source i's dataset is built for ceil(ceil(n x w_i) x 1.005) samples, a margin that also fixes how many
epochs, hence which shuffle, that source gets. Weights are normalised as Megatron does it (once by the
builder, once more by the blend); sources of weight 0 are left out.

The greedy choice is a loop over samples (Megatron's is C++); in Python it takes about 0.3 s per
million samples for a handful of sources. The result is cached beside the data (build.py).

A phase list [(start_sample, weights), ...] -- a Ternion addition -- switches weights at start_sample;
within each phase the interleave starts afresh with that phase's weights, and each source's samples
continue where the previous phase left them, so no source sample is served twice.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# Megatron-LM's mid_level_dataset_surplus: each source's dataset is built this much larger than its share.
SURPLUS = 0.005


def normalise(weights: Sequence[float]) -> list[float]:
    """Weights over their sum, in float64 (megatron.core.datasets.utils.normalize's arithmetic)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blend_sizes(weights: Sequence[float], size: int, surplus: float = SURPLUS) -> tuple[int, list[int]]:
    """(the blend's length, each source's dataset size) when n = `size` samples are asked for, as
    Megatron-LM's BlendedMegatronDatasetBuilder sizes them: sum(ceil(n x w_i)) and ceil(ceil(n x w_i) x
    (1 + surplus)), with w the normalised weights. A source of weight 0 gets 0."""
    w = normalise(_checked(weights, len(weights)))
    targets = [int(math.ceil(size * wi)) for wi in w]
    return sum(targets), [int(math.ceil(t * (1 + surplus))) for t in targets]


def megatron_interleave(weights: Sequence[float], size: int) -> np.ndarray:
    """The source of each of `size` positions: megatron-core's build_blending_indices for these
    (normalised) weights -- at position s, the first source maximising w_i x max(s, 1) - taken_i."""
    w = [float(x) for x in weights]
    k = len(w)
    if k == 1:
        return np.zeros(size, dtype=np.int16)
    if k > 16:
        return _interleave_numpy(np.asarray(w, dtype=np.float64), size)
    taken = [0] * k
    out = bytearray(size)
    w0, rest = w[0], list(zip(range(1, k), w[1:]))
    for s in range(size):
        n = s if s > 1 else 1  # int x float is the same double product as C++'s double(n) * w
        best, top = 0, w0 * n - taken[0]
        for i, wi in rest:
            lag = wi * n - taken[i]
            if lag > top:
                best, top = i, lag
        out[s] = best
        taken[best] += 1
    return np.frombuffer(bytes(out), dtype=np.uint8).astype(np.int16)


def _interleave_numpy(w: np.ndarray, size: int) -> np.ndarray:
    """The same choice for many sources: one numpy argmax (first maximum) per position."""
    taken = np.zeros(len(w), dtype=np.int64)
    out = np.empty(size, dtype=np.int16)
    for s in range(size):
        best = int(np.argmax(w * float(max(s, 1)) - taken))
        out[s] = best
        taken[best] += 1
    return out


def blend_indices(phases: Sequence[tuple[int, Sequence[float]]], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample, index of that sample within its source) for positions [0, size).

    `phases` is sorted by start, and the first starts at 0. With one phase this is megatron-core's
    (dataset_index, dataset_sample_index) for those weights and this size.
    """
    if not phases or phases[0][0] != 0:
        raise ValueError("the first blend phase must start at sample 0")
    starts = [int(s) for s, _ in phases]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"blend phases must start at increasing samples, got {starts}")
    num_sources = len(phases[0][1])
    source = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    taken = np.zeros(num_sources, dtype=np.int64)
    bounds = starts + [size]
    for (start, weights), end in zip(phases, bounds[1:]):
        end = min(end, size)
        if start >= end:
            continue
        w = _checked(weights, num_sources)
        used = np.flatnonzero(np.asarray(w) > 0)
        # The builder normalises the --data-path weights, the blend normalises them again: both, as Megatron.
        s = used[megatron_interleave(normalise(normalise([w[i] for i in used])), end - start)].astype(np.int16)
        source[start:end] = s
        for i in used:
            mine = s == i
            within[start:end][mine] = taken[i] + np.arange(int(mine.sum()), dtype=np.int64)
        taken += np.bincount(s, minlength=num_sources)
    return source, within


def _checked(weights: Sequence[float], num_sources: int) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_sources,) or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be {num_sources} non-negative numbers with a positive sum")
    return [float(x) for x in weights]


class BlendedDataset:
    """`ds[i]` is sample `within[i]` of `datasets[source[i]]`."""

    def __init__(self, datasets: Sequence, source: np.ndarray, within: np.ndarray):
        self.datasets = list(datasets)
        self.source, self.within = source, within
        for i, ds in enumerate(self.datasets):
            needed = int(within[source == i].max(initial=-1)) + 1
            if ds is not None and len(ds) < needed:
                raise ValueError(f"blend source {i} has {len(ds)} samples but the blend needs {needed}")

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.source[i])][int(self.within[i])]

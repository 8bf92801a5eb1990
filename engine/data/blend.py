"""Weighted blends of datasets, with phases that change the weights at given sample positions.

The interleave is deterministic, not a random draw: source i's k-th sample is due at position
(k + 1/2) / w_i, and positions are filled in order of due time (ties to the lower source id). After n
samples source i therefore holds round(T * w_i) of them for the T at which n were due, so its count
stays within about (number of sources + 1) / 2 of w_i * n at every prefix: with a handful of sources a
window of 1,000 samples is within 1% of the weights. It is the same idea as "always take the source
furthest below its target", computed with one sort instead of a loop over samples.

A phase list [(start_sample, weights), ...] switches weights at start_sample; each source's samples
continue where the previous phase left them, so no source sample is served twice.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def blend_indices(phases: Sequence[tuple[int, Sequence[float]]], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample, index of that sample within its source) for positions [0, size).

    `phases` is sorted by start, and the first starts at 0.
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
        s, k = _interleave(_normalised(weights, num_sources), end - start)
        source[start:end] = s
        within[start:end] = taken[s] + k
        taken += np.bincount(s, minlength=num_sources)
    return source, within


def _normalised(weights: Sequence[float], num_sources: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_sources,) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be {num_sources} non-negative numbers with a positive sum")
    return w / w.sum()


def _interleave(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n samples by due time: (source, k-th sample of that source)."""
    sources, ks, due = [], [], []
    for i, wi in enumerate(w):
        if wi == 0:
            continue
        count = int(np.ceil(n * wi + len(w))) + 1  # enough: a source never runs more than len(w) ahead
        k = np.arange(count, dtype=np.int64)
        sources.append(np.full(count, i, dtype=np.int16))
        ks.append(k)
        due.append((k + 0.5) / wi)
    order = np.argsort(np.concatenate(due), kind="stable")[:n]
    return np.concatenate(sources)[order], np.concatenate(ks)[order]


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

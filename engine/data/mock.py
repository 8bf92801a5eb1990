"""Synthetic samples for benchmarks and layout tests (--mock-data).

Sample i depends only on (seed, i), so every parallel layout sees the same global batches. The tokens
are learnable: each sample is an arithmetic progression modulo the vocabulary with a step drawn from
{1, 2, 3, 4}, and one token in ten is replaced by uniform noise. A model that learns "next = previous +
step" drives the loss from ln(vocab) towards the noise floor, so a falling loss means training works.
"""
from __future__ import annotations

import numpy as np

NOISE = 0.1
STEPS = 4


class MockGPTDataset:
    """`ds[i]` -> np.int64 array of seq_length + 1 tokens in [0, vocab_size)."""

    def __init__(self, seq_length: int, vocab_size: int, num_samples: int, seed: int):
        if vocab_size < STEPS + 1:
            raise ValueError(f"mock data needs a vocabulary of at least {STEPS + 1} tokens, got {vocab_size}")
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"mock sample {i} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, int(i)])
        n = self.seq_length + 1
        start = rng.integers(self.vocab_size)
        step = rng.integers(1, STEPS + 1)
        tokens = (start + step * np.arange(n, dtype=np.int64)) % self.vocab_size
        noisy = rng.random(n) < NOISE
        tokens[noisy] = rng.integers(self.vocab_size, size=int(noisy.sum()))
        return tokens

"""Named random streams so dropout is right under tensor parallelism, and recomputation replays it.

Activations replicated over TP must see the same dropout mask on every TP rank: they use the default
generator, seeded the same within a TP group. Activations split over TP (attention heads; everything
under sequence parallelism) must see different masks: they run inside `fork("tp")`, a stream seeded
per TP rank. Context-parallel ranks hold different positions of the same sequences, so both their
streams are seeded apart (by `_CP_SEED_OFFSET` per CP rank): no two positions share a mask by layout.
Recomputation saves and restores every stream so replayed masks match.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

TP_STREAM = "tp"
_TP_SEED_OFFSET = 2718  # any constant: keeps the TP stream apart from the default one
_CP_SEED_OFFSET = 1_000_003  # a prime far above 100 x pp: keeps CP ranks' streams apart from every stage's


def _get_state(device_type):
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(state, device_type):
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.states: dict = {}

    @classmethod
    def for_context(cls, ctx, seed: int, device_type: str = "cpu") -> "RNGTracker":
        """Seed python/numpy/torch (same within a TP group, distinct per pipeline stage and CP rank) and the TP
        stream."""
        base = seed + 100 * ctx.pp_rank + _CP_SEED_OFFSET * getattr(ctx, "cp_rank", 0)
        random.seed(base)
        np.random.seed(base % 2 ** 32)
        torch.manual_seed(base)
        tracker = cls(device_type)
        tracker.add(TP_STREAM, base + _TP_SEED_OFFSET + ctx.tp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        saved = _get_state(self.device_type)
        torch.manual_seed(seed) if self.device_type == "cpu" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(saved, self.device_type)

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        saved = _get_state(self.device_type)
        _set_state(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(saved, self.device_type)

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def capture(tracker) -> tuple:
    """Everything a replay needs: the default generator and each tracked stream."""
    default = _get_state(tracker.device_type) if tracker else torch.get_rng_state()
    return default, (tracker.get_states() if tracker else None)


def restore(tracker, snapshot) -> None:
    default, streams = snapshot
    _set_state(default, tracker.device_type if tracker else "cpu")
    if tracker:
        tracker.set_states(streams)

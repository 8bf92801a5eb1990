"""A recipe and the scaler of one tensor: how a linear's input, weight or output gradient gets its FP8 scale.

tensorwise (Megatron-LM's current scaling): the amax of this tensor now, taken over every rank holding a part
of it (the linear's `group`: tp and cp; never dp, whose ranks hold other microbatches). delayed: the scale of
the amax history (its max or most recent entry, Transformer Engine's rule) with no communication in the step;
each tensor's amax is kept over the step's microbatches, reduced once per step over every rank of the pipeline
stage (tp, cp and dp: Megatron-LM's amax reduction group) and pushed into the history, so every layout sees
the same history. A history still empty (the first step) scales like tensorwise. blockwise: tiles (see
engine.fp8.quantize), no state.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from engine.fp8.quantize import (Quantized, Split, amax, codes_of, fp8_dtype, fp8_max, group_amax, quantize,
                                 quantize_tiles, scale_of)
from kernels.reference import FromAmax

ACTIVATION_TILE, WEIGHT_TILE = (1, 128), (128, 128)


@dataclass(frozen=True)
class Recipe:
    fmt: str                  # e4m3 | hybrid
    kind: str                 # tensorwise | delayed | blockwise
    history_len: int = 1
    algo: str = "most_recent"
    margin: int = 0

    @classmethod
    def of(cls, training) -> Optional["Recipe"]:
        """The run's recipe from its training section, None without --fp8-format."""
        if training.fp8_format is None:
            return None
        return cls(training.fp8_format, training.fp8_recipe, training.fp8_amax_history_len,
                   training.fp8_amax_compute_algo, training.fp8_margin)

    @property
    def blockwise(self) -> bool:
        return self.kind == "blockwise"

    @property
    def delayed(self) -> bool:
        return self.kind == "delayed"


class Scaler:
    """Quantizes one tensor of one linear (its input, weight or output gradient), keeping its history."""

    def __init__(self, recipe: Recipe, gradient: bool, device=None):
        self.recipe, self.dtype = recipe, fp8_dtype(recipe.fmt, gradient)
        self.history = torch.zeros(recipe.history_len, device=device)
        self.steps = 0                                  # entries pushed into the history
        self.seen = torch.zeros((), device=device)      # this step's amax so far, this rank's
        self.scale = torch.ones((), device=device)      # the history's scale
        self.scale_inv = torch.ones((), device=device)  # its reciprocal, the GEMMs' decode scale
        self.last = None                                # the decode scale(s) it last quantized with
        self.noted = None                               # the amax its last `tensor` call noted (as `saw` took it)

    def tensor(self, x: torch.Tensor, group=None, transposed: bool = False) -> Quantized:
        """x [M, K] with one scale; `group`: the other ranks holding parts of x (current scaling reduces over it);
        `transposed`: with its transpose made in the same pass (`Quantized.t` then gives it)."""
        def make(scale):
            if transposed:  # the amax comes with the codes where a scale from the history needs it
                return codes_of(x, scale, self.dtype, self.from_history, self.decode(scale),
                                self.running(x.device))
            return quantize(x, scale, self.dtype, self.decode(scale)), None
        return self.produce(lambda: amax(x), make, group, derive=transposed)

    def produce(self, measure, make, group=None, derive: bool = False):
        """A tensor with one scale that `make(encode scale)` quantizes, returning (what it made, the tensor's amax
        or None), `measure()` giving that amax alone (this rank's part). A scale from the history is known before:
        the tensor is made at once, the amax taken with it where `make` gives it (or max-ed by it into the step's
        running amax, `running`: then none is noted); current scaling measures first and reduces over `group`, and
        with `derive` hands `make` a FromAmax, whose scale the codes kernel derives itself (one launch instead of the
        ten or so small operations of `encode_scale` and the decode scale). What `make` made is returned; the amax is
        noted as `tensor`'s is."""
        if self.from_history:
            made, now = make(self.scale)
            if now is self.seen:  # `make` max-ed the tensor's amax into the step's in place (`running`)
                self.noted = None
                return made
            now = measure() if now is None else now
        else:
            now = group_amax(measure(), group)
            scale = FromAmax(now, self.recipe.margin, torch.empty((), device=now.device)) if derive \
                else self.encode_scale(now)
            made, _ = make(scale)
        self.saw(now)
        self.noted = now
        return made

    def running(self, device) -> Optional[torch.Tensor]:
        """Where a tensor on `device` made with the history's scale may max its amax into in place: the step's
        running amax (`seen`; the codes kernels do it in the launch that writes the codes), or None before the
        history has an entry (current scaling needs the amax first) or where `seen` lives elsewhere."""
        return self.seen if self.from_history and self.seen.device == device else None

    @property
    def from_history(self) -> bool:
        """Delayed scaling once the history has an entry: the scale is the history's, no amax is reduced."""
        return self.recipe.delayed and self.steps > 0

    def encode_scale(self, now: torch.Tensor) -> torch.Tensor:
        """The scale `tensor` quantizes with, for a tensor whose amax (over its group, unless from_history) is
        `now`: the history's, or current scaling's."""
        return self.scale if self.from_history else scale_of(now, self.dtype, self.recipe.margin)

    def saw(self, now: torch.Tensor) -> None:
        """Delayed scaling: a quantized tensor's amax `now` enters the step's amax (reduced over the stage later)."""
        if self.recipe.delayed:
            self.seen = torch.maximum(self.seen, now)

    def tiles(self, x: torch.Tensor, tile: tuple, split: Optional[Split] = None) -> Quantized:
        return quantize_tiles(x, tile, self.dtype, self.recipe.margin, split)

    def state(self) -> dict:
        """What a checkpoint keeps (JSON: fp32 values are exact as Python floats)."""
        return {"history": self.history.tolist(), "steps": self.steps}

    def load(self, state: dict) -> None:
        """A saved history; one of another length keeps its most recent entries (zeros beyond them)."""
        saved = torch.tensor(state["history"], dtype=torch.float32, device=self.history.device)
        history = torch.zeros_like(self.history)
        n = min(len(saved), len(history))
        history[:n] = saved[:n]
        self.steps, self.seen = int(state["steps"]), torch.zeros_like(self.seen)
        self._follow(history, *_scales(history.unsqueeze(0), self.recipe, [self.dtype]))

    def _follow(self, history, scale, scale_inv) -> None:
        self.history, self.scale, self.scale_inv = history, scale.reshape(()), scale_inv.reshape(())

    def decode(self, scale: torch.Tensor) -> torch.Tensor:
        """1 / `scale`, the decode scale a GEMM takes: the history's was computed with it (once a step for every
        scaler, `push_all`), any other here."""
        if isinstance(scale, FromAmax):  # written where the scale is derived
            return scale.inv
        return self.scale_inv if scale is self.scale else scale.float().reshape(()).reciprocal()


@functools.lru_cache(maxsize=16)
def _tops(dtypes: tuple, device) -> torch.Tensor:
    """The formats' largest values [n] on `device`, made once (a copy from host memory every step would wait for
    the device's queue to drain)."""
    return torch.tensor([fp8_max(d) for d in dtypes], device=device)


def _scales(histories: torch.Tensor, recipe: Recipe, dtypes: list) -> tuple:
    """(encode scales [n], their reciprocals) of n histories [n, L] under `recipe`, scaler i's format dtypes[i]."""
    use = histories.amax(1) if recipe.algo == "max" else histories[:, 0]
    scales = scale_of(use, _tops(tuple(dtypes), histories.device), recipe.margin)
    return scales, scales.reciprocal()


def push_all(scalers: list, step_amax: torch.Tensor) -> None:
    """End of step for `scalers` (one recipe, one history length): their step amaxes [n], reduced over the stage's
    ranks, enter their histories, and each scale follows, as a few operations over all of them (one scaler at a time
    took about ten kernel launches each: 2,000 a step of the 16-layer 1.3B model, on the H200 of 2026-11-27). The
    numbers are those of one at a time: elementwise, the same operations."""
    if not scalers:
        return
    recipe = scalers[0].recipe
    histories = torch.stack([s.history for s in scalers])
    histories = torch.cat([step_amax.reshape(-1, 1).to(histories.dtype), histories[:, :-1]], dim=1)
    scales, inverses = _scales(histories, recipe, [s.dtype for s in scalers])
    seen = torch.zeros(len(scalers), device=histories.device)
    for s, history, scale, inverse, zero in zip(scalers, histories.unbind(0), scales.unbind(0), inverses.unbind(0),
                                                seen.unbind(0)):
        s._follow(history, scale, inverse)
        s.steps += 1
        s.seen = zero

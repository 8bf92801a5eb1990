"""Every random stream of a rank as JSON (python, numpy, torch, cuda, the TP tracker), and back.

Torch generator states are byte tensors; they travel as base64 text so metadata.json stays plain JSON.
"""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _pack(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unpack(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture(tracker=None) -> dict:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _pack(torch.get_rng_state()),
        "cuda": _pack(torch.cuda.get_rng_state()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": None,
    }
    if tracker is not None:
        state["tracker"] = {"device_type": tracker.device_type,
                            "streams": {k: _pack(v) for k, v in tracker.get_states().items()}}
    return state


def restore(state: dict, tracker=None) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unpack(state["torch"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unpack(state["cuda"]))
    if tracker is not None and state.get("tracker"):
        tracker.set_states({k: _unpack(v) for k, v in state["tracker"]["streams"].items()})

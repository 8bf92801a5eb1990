"""Megatron-Core's distributed-optimizer state as Ternion's per-parameter optimizer state.

Ternion keeps, per parameter, fp32 `exp_avg`, `exp_avg_sq` and `master` (engine/optim/optimizer.py), the Adam
step and the loss scaler. Megatron-Core's DistributedOptimizer.sharded_state_dict (0.16) stores the same numbers
in one of these layouts (`param_state_sharding_type`):
- fully_reshardable (Megatron-LM --dist-ckpt-optim-fully-reshardable) and fully_sharded_model_space (the layout
  of earlier releases): model space, one tensor per parameter and state, keyed
  `optimizer.state.<exp_avg|exp_avg_sq|param|fp32_param>.<the parameter's key>`, with the parameter's own global
  shape, so each maps like the weight it belongs to;
- dp_reshardable (Megatron-LM's default): bucket space, see bucket_space.py.
The Adam step is the optimizer's param_groups' `step`, the loss scaler Megatron's DynamicGradScaler (scale,
growth_tracker, hysteresis_tracker): both in the common state, or in sharded objects under
`optimizer.distributed.dp_group_idx_<i>.` in the bucket layout.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from engine.checkpoint.megatron.bucket_space import BucketSpace
from engine.checkpoint.megatron.pickled import Opaque

MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
_STATE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|param|fp32_param)\.(.+)$")
OURS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "master", "fp32_param": "master"}


def _groups(optimizer_state) -> list:
    """Every inner optimizer's state dict (a ChainedOptimizer saves {0: ..., 1: ...})."""
    if not isinstance(optimizer_state, dict):
        return []
    if "param_groups" in optimizer_state.get("optimizer", {}) or "param_state_sharding_type" in optimizer_state:
        return [optimizer_state]
    return [v for k, v in sorted(optimizer_state.items(), key=lambda kv: str(kv[0])) if isinstance(v, dict)]


def _number(value) -> float:
    if isinstance(value, Opaque):
        value = value.value
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class MegatronOptimizer:
    """The optimizer state of one Megatron checkpoint, by the stored key of the parameter it belongs to."""

    def __init__(self, ck, model_entries: dict):
        """`model_entries`: Ternion name -> (stored key, leading indices) of its weight."""
        self.ck, self.why_not = ck, None
        common = ck.common.get("optimizer")
        states = _groups(common)
        kinds = {s.get("param_state_sharding_type") for s in states} - {None}
        self.sharding = kinds.pop() if len(kinds) == 1 else None
        self.state_keys = {}
        for key in ck.tensors.shapes:
            match = _STATE_KEY.match(key)
            if match:
                self.state_keys.setdefault(match.group(2), {})[OURS[match.group(1)]] = key
        self.buckets = None
        if self.sharding == "dp_reshardable":
            self.buckets = BucketSpace.open(ck, model_entries)
            self.why_not = self.buckets.why_not
        elif common is None:
            self.why_not = "the checkpoint holds no optimizer state (saved with --no-save-optim)"
        elif ck.format == "torch":
            self.why_not = "the legacy torch format's optimizer state (in model_optim_rng.pt, distrib_optim.pt) is " \
                           "not read"
        elif self.sharding not in MODEL_SPACE and not self.state_keys:
            self.why_not = f"its optimizer layout ({self.sharding or 'not a distributed optimizer'}) is not read"
        self.inner = self.buckets.inner if self.buckets is not None else [s.get("optimizer", {}) for s in states]
        self.scaler_state = self.buckets.scaler if self.buckets is not None else \
            next((s["grad_scaler"] for s in states if s.get("grad_scaler")), None)

    @property
    def present(self) -> bool:
        return self.why_not is None

    def step(self) -> int:
        steps = {_number(g["step"]) for inner in self.inner for g in inner.get("param_groups", []) if "step" in g}
        return int(max(steps)) if steps else 0

    def scaler(self, fp16: bool) -> dict:
        """Ternion's LossScaler state (engine/optim/loss_scaler.py) from Megatron's grad scaler."""
        s = self.scaler_state
        if not fp16 or not s:
            return {"scale": 1.0, "dynamic": False, "clean_steps": 0, "hysteresis_left": 0}
        return {"scale": _number(s["scale"]), "dynamic": "growth_tracker" in s,
                "clean_steps": int(_number(s.get("growth_tracker", 0))),
                "hysteresis_left": int(_number(s.get("hysteresis_tracker", 0)))}

    def keys_for(self, where: tuple) -> Optional[dict]:
        """Ternion state key -> where its stored tensor is, for the parameter stored at `where`; None if absent."""
        if self.buckets is not None:
            return self.buckets.keys_for(where)
        stored = self.state_keys.get(where[0])
        return {k: (key, where[1]) for k, key in stored.items()} if stored else None

    def read(self, located: tuple) -> torch.Tensor:
        if self.buckets is not None:
            return self.buckets.read(located)
        return self.ck.tensors.read(*located).to(torch.float32)

"""fp16 loss scaling: a static scale, or Megatron-LM's dynamic scaler with hysteresis.

Dynamic rule (Megatron's DynamicGradScaler: growth interval 1000, factor 2; hysteresis from --hysteresis,
default 2 as in Megatron-LM; 1 halves the scale at the first overflow):
a step whose gradients hold inf/nan is skipped; each such step spends one unit of hysteresis and, once
none is left, halves the scale (never below `min_scale`). After `growth_interval` clean steps in a row
the scale doubles and the hysteresis is refilled. So with hysteresis 2 the first overflow after a
growth only skips the step; the second halves the scale, and every further one halves it again.
bf16 and fp32 runs use the constant scale 1, but still skip steps whose gradients are not finite.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, scale: float = 1.0, *, dynamic: bool = False, growth_interval: int = 1000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    @classmethod
    def from_config(cls, training) -> "LossScaler":
        """`training` is a TrainingConfig: --fp16 with --loss-scale (static) or --initial-loss-scale."""
        if not training.fp16:
            return cls(1.0)
        if training.loss_scale:
            return cls(training.loss_scale)
        return cls(training.initial_loss_scale, dynamic=True, hysteresis=training.hysteresis)

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "dynamic": self.dynamic, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """A static scale stays what the flags say; a dynamic one resumes where it was."""
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self._clean_steps = int(state.get("clean_steps", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))

"""The number format a run computes in (--bf16, --fp16, else fp32): by name for the memory estimate and the
start-up report, and as the torch dtype of parameters and activations for the trainer.
"""
from __future__ import annotations

from engine.config import Config


def precision_name(cfg: Config) -> str:
    return "bf16" if cfg.training.bf16 else "fp16" if cfg.training.fp16 else "fp32"


def model_dtype(cfg: Config):
    """The torch dtype of parameters and activations (torch is imported here only: tools read configs without it)."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision_name(cfg)]

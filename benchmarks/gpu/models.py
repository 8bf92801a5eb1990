"""The two model shapes the check trains, at each size it needs, as run configs.

Llama-shaped: configs/llama3-1b.yaml (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied 128k vocabulary;
1.24B parameters, the issue's "~1.3B"). GPT-2-shaped: configs/gpt2-125m.yaml (LayerNorm, learned positions,
GELU, biases). "full" is the real model at the issue's sequence length; "small" a few-layer cut of the same
shape that a CPU steps in a second (the fp32 CUDA-vs-CPU step); "tiny" the dry run's size.
"""
from __future__ import annotations

import os

from engine.cli import parse_config
from engine.resolve import resolve
from engine.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {"llama": "configs/llama3-1b.yaml", "gpt2": "configs/gpt2-125m.yaml"}
SEQ = {"llama": 2048, "gpt2": 1024}
# layers, hidden, heads, kv groups (Llama only), ffn, seq, vocab
CUTS = {"small": (2, 256, 4, 2, 512, 128, 2048), "tiny": (2, 64, 4, 2, 128, 64, 512)}


def flags(family: str, size: str) -> list:
    """pretrain_gpt.py flags of `family` at `size`."""
    argv = ["--config", os.path.join(ROOT, CONFIGS[family]), "--tp", "1", "--pp", "1", "--mock-data"]
    if size == "full":
        return argv + ["--seq-length", str(SEQ[family]), "--max-position-embeddings", str(SEQ[family])]
    layers, hidden, heads, groups, ffn, seq, vocab = CUTS[size]
    argv += ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(ffn), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
             "--vocab-size", str(vocab)]
    return argv + (["--num-query-groups", str(groups)] if family == "llama" else [])


def config(family: str, size: str, micro_batch: int, microbatches: int, iters: int, bf16: bool, extra=()):
    """A validated one-device Config: `microbatches` of `micro_batch` per step, `iters` iterations, no
    checkpoints, evaluation or logs (benchmarks/train.py's settings)."""
    cfg = parse_config(flags(family, size) + ["--micro-batch-size", str(micro_batch), "--global-batch-size",
                                              str(micro_batch * microbatches), "--train-iters", str(iters), *extra])
    cfg.training.bf16 = bf16
    validate(cfg, 1)
    resolve(cfg, 1)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logging.eval_interval = cfg.logging.metrics_file = cfg.logging.tensorboard_dir = None
    cfg.logging.profile = False
    return cfg

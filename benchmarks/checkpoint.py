"""How long a checkpoint save stalls training: synchronous vs --async-save, measured in one run.

    python benchmarks/checkpoint.py [--hidden-size 512] [--num-layers 8] [--repeats 3] [--dir DIR] [--json]

Builds a GPT model and its AdamW optimizer on one process (CPU, or the current GPU), then times
`save_checkpoint` returning: synchronously (write, fsync, checksum, publish) and asynchronously
(only the copy off the training tensors; the write runs in the background and is waited for
outside the timed region). Reports the best of `--repeats` for each, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

import torch

from engine.checkpoint import save_checkpoint
from engine.config import Config
from engine.optim import build_optimizer
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks


def measure(hidden_size: int, num_layers: int, repeats: int, directory: str) -> dict:
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_layers, m.num_attention_heads, m.vocab_size = hidden_size, num_layers, 8, 32000
    ctx = ParallelContext.virtual()
    device = "cuda" if torch.cuda.is_available() else None
    chunks = build_model_chunks(cfg, ctx, vocab_size=m.vocab_size, device=device)
    opt = build_optimizer(cfg, chunks, ctx)
    state_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters()) + opt.state_bytes()
    timings = {"sync": [], "async": []}
    iteration = 0
    for _ in range(repeats):
        for mode in ("sync", "async"):
            iteration += 1
            start = time.perf_counter()
            pending = save_checkpoint(directory, iteration, chunks, opt, ctx, cfg, {"consumed_samples": iteration},
                                      async_save=mode == "async")
            timings[mode].append(time.perf_counter() - start)
            if pending is not None:
                pending.finish()  # outside the timed region: this is what training overlaps with
    sync, stall = min(timings["sync"]), min(timings["async"])
    return {"state_mb": state_bytes / 2 ** 20, "sync_save_s": sync, "async_stall_s": stall,
            "stall_ratio": stall / sync, "device": str(device or "cpu")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="where to write (default: a temporary folder, removed afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    directory = args.dir or tempfile.mkdtemp(prefix="ternion-ckpt-bench-")
    try:
        result = measure(args.hidden_size, args.num_layers, args.repeats, directory)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"state {result['state_mb']:.0f} MB on {result['device']}: synchronous save {result['sync_save_s']:.3f} s, "
              f"async stall {result['async_stall_s']:.3f} s, ratio {result['stall_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

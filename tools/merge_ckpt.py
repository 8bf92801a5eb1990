"""Consolidate a sharded checkpoint into one file, or split it into another (tp, pp) layout.

    python tools/merge_ckpt.py --load SAVE_DIR [--iteration N] --out DIR [--format native|hf]
    python tools/merge_ckpt.py --load SAVE_DIR [--iteration N] --out DIR --target-tp T --target-pp P

native: DIR/model.safetensors (every tensor whole, vocabulary padding removed) and DIR/config.json;
engine.checkpoint.load_merged loads it into a model of any layout.
hf: a folder transformers loads with from_pretrained (LlamaForCausalLM or GPT2LMHeadModel).
--target-tp/--target-pp: DIR becomes a checkpoint directory for that layout (dp 1), optimizer included.
Tensors are streamed one at a time, so memory stays near the largest tensor, not the model.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint import files  # noqa: E402
from engine.checkpoint.hf import export_hf  # noqa: E402
from engine.checkpoint.merged import merge_native, split  # noqa: E402
from engine.checkpoint.reader import CheckpointReader  # noqa: E402
from engine.config import ConfigError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Merge a sharded Ternion checkpoint, or split it into another layout.")
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of the run)")
    p.add_argument("--iteration", type=int, help="iteration to read (default: the latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=("native", "hf"), default="native", help="merged format (default native)")
    p.add_argument("--target-tp", type=int, help="split into this tensor-parallel size instead of merging")
    p.add_argument("--target-pp", type=int, help="split into this pipeline-parallel size instead of merging")
    return p.parse_args(argv)


def open_checkpoint(load: str, iteration) -> CheckpointReader:
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: directory not found; give the --save directory of a run")
    if iteration is None:
        iteration = files.read_latest(load)
        if iteration is None:
            raise ConfigError(f"--load {load}: no {files.LATEST_FILE}; pass --iteration N")
    path = os.path.join(load, files.iter_dir_name(iteration))
    if not os.path.isdir(path):
        have = ", ".join(map(str, files.list_iterations(load))) or "none"
        raise ConfigError(f"--iteration {iteration}: {path} not found; saved iterations: {have}")
    reader = CheckpointReader(path)
    problem = reader.check_files(reader.meta["files"])
    if problem:
        raise ConfigError(problem)
    return reader


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if (args.target_tp is None) != (args.target_pp is None):
            raise ConfigError("--target-tp/--target-pp: give both to split, or neither to merge")
        reader = open_checkpoint(args.load, args.iteration)
        if args.target_tp is not None:
            if args.target_tp < 1 or args.target_pp < 1:
                raise ConfigError(f"--target-tp {args.target_tp} --target-pp {args.target_pp}: sizes must be at least 1")
            split(reader, args.out, args.target_tp, args.target_pp)
            print(f"iteration {reader.iteration} split into tp {args.target_tp} x pp {args.target_pp} under {args.out}")
        elif args.format == "hf":
            arch = export_hf(reader, args.out)
            print(f"iteration {reader.iteration} exported as a transformers {arch} model to {args.out}")
        else:
            merge_native(reader, args.out)
            print(f"iteration {reader.iteration} merged into {args.out}")
    except ConfigError as e:
        print(f"merge_ckpt.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

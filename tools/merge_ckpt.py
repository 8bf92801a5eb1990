"""Consolidate a sharded checkpoint into one file, or split it into another (tp, pp) layout.

    python tools/merge_ckpt.py --load SAVE_DIR [--iteration N] --out DIR [--format native|hf]
    python tools/merge_ckpt.py --load SAVE_DIR [--iteration N] --out DIR --target-tp T --target-pp P

native: DIR/model.safetensors (every tensor whole, vocabulary padding removed) and DIR/config.json;
engine.checkpoint.load_merged loads it into a model of any layout.
hf: a folder transformers loads with from_pretrained (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Olmo2ForCausalLM or GPT2LMHeadModel; MoE models as MixtralForCausalLM, Qwen2MoeForCausalLM or
Qwen3MoeForCausalLM, or refused in one line).
--target-tp/--target-pp: DIR becomes a checkpoint directory for that layout (dp 1), optimizer included.
Tensors are streamed one at a time, so memory stays near the largest tensor, not the model.
"""
from __future__ import annotations

import argparse
import sys

from engine.checkpoint.hf import export_hf
from engine.checkpoint.merged import merge_native, split
from engine.checkpoint.reader import open_iteration
from engine.cli import OneLineParser
from engine.config import ConfigError
from engine.run.lock import tool_output


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="merge_ckpt.py", script="tools/merge_ckpt.py",
                      description="Merge a sharded Ternion checkpoint, or split it into another layout.")
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of the run)")
    p.add_argument("--iteration", type=int, help="iteration to read (default: the latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=("native", "hf"), default="native", help="merged format (default native)")
    p.add_argument("--target-tp", type=int, help="split into this tensor-parallel size instead of merging")
    p.add_argument("--target-pp", type=int, help="split into this pipeline-parallel size instead of merging")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if (args.target_tp is None) != (args.target_pp is None):
            raise ConfigError("--target-tp/--target-pp: give both to split, or neither to merge")
        reader = open_iteration(args.load, args.iteration)
        with tool_output(args.out):  # not a running job's --save; a read-only or full --out is one line
            if args.target_tp is not None:
                if args.target_tp < 1 or args.target_pp < 1:
                    raise ConfigError(f"--target-tp {args.target_tp} --target-pp {args.target_pp}: sizes must be at "
                                      "least 1")
                split(reader, args.out, args.target_tp, args.target_pp)
                done = f"iteration {reader.iteration} split into tp {args.target_tp} x pp {args.target_pp} under " \
                       f"{args.out}"
            elif args.format == "hf":
                done = f"iteration {reader.iteration} exported as a transformers {export_hf(reader, args.out)} " \
                       f"model to {args.out}"
            else:
                merge_native(reader, args.out)
                done = f"iteration {reader.iteration} merged into {args.out}"
        print(done)
    except ConfigError as e:
        print(f"merge_ckpt.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

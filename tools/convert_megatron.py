"""Megatron-LM checkpoints in and out of Ternion.

    python tools/convert_megatron.py --load MEGATRON_SAVE [--iteration N] --out SAVE_DIR
    python tools/convert_megatron.py --to-megatron --load SAVE [--iteration N] --out MEGATRON_SAVE
                                     [--target-tp T --target-pp P]

In: MEGATRON_SAVE is a Megatron-LM `--save` directory (or one of its iter_NNNNNNN folders) in the torch_dist format
(.distcp shards, common.pt, metadata.json) or the legacy torch format (mp_rank_XX[_YYY]/model_optim_rng.pt);
megatron-core GPT models: GPT-2-, Llama- and MoE-shaped, saved at any tp/pp/ep. SAVE_DIR gets a Ternion
checkpoint at the same iteration (it loads at any layout) with the distributed optimizer's state, the consumed
samples and the LR schedule where present, and `model.yaml`, a --config file of the run's model, schedule and
batch flags. Continue the run: `launch/pretrain_gpt.py --config SAVE_DIR/model.yaml --load SAVE_DIR --data-path
... --save RUN` (or give launch/pretrain_gpt.py the Megatron directory itself as --load). RNG states are not
carried over.
Out: MEGATRON_SAVE gets a torch_dist save of the weights for a Megatron-LM run at tp T x pp P (default 1 x 1),
with latest_checkpointed_iteration.txt and the args Megatron-LM's load_checkpoint reads; the optimizer state is not
written. A mistake, or a checkpoint Ternion cannot read whole, is one line and exit status 2, before anything
is written.
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml
from tqdm import tqdm

from engine.checkpoint.megatron import export_megatron, import_megatron
from engine.checkpoint.megatron.args import run_flags
from engine.checkpoint.reader import open_iteration
from engine.cli import OneLineParser
from engine.config import ConfigError
from engine.flags import command_line

CONFIG_FILE = "model.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="convert_megatron.py", script="tools/convert_megatron.py",
                      description="Convert a Megatron-LM checkpoint (torch_dist or torch) into a Ternion checkpoint, "
                                  "or a Ternion checkpoint into Megatron-LM's torch_dist (--to-megatron).")
    p.add_argument("--load", required=True, help="the Megatron-LM --save directory (with --to-megatron: Ternion's)")
    p.add_argument("--iteration", type=int, help="iteration to read (default: the latest)")
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--to-megatron", action="store_true", help="write Megatron-LM's torch_dist instead")
    p.add_argument("--target-tp", type=int, help="with --to-megatron: the Megatron run's tensor-parallel size")
    p.add_argument("--target-pp", type=int, help="with --to-megatron: the Megatron run's pipeline-parallel size")
    return p.parse_args(argv)


def _bar(what: str):
    return lambda total: tqdm(total=total, unit=" tensors", desc=what, disable=None, leave=False)


def to_ternion(args) -> list:
    cfg, ck, notes = import_megatron(args.load, args.out, args.iteration, progress=_bar("converting"))
    values = run_flags(cfg)
    path = os.path.join(args.out, CONFIG_FILE)
    with open(path, "w") as fh:
        fh.write(f"# The flags of the Megatron-LM run saved in {ck.path} (tools/convert_megatron.py).\n"
                 f"# Continue it: launch/pretrain_gpt.py --config {path} --load {args.out} --data-path ... "
                 "--save RUN\n")
        yaml.safe_dump(values, fh, sort_keys=False)
    return notes + [f"converted into {args.out} (iteration {ck.iteration}; loads at any layout)",
                    f"flags: {command_line(values)}", f"config: {path}"]


def to_megatron(args) -> list:
    if (args.target_tp is None) != (args.target_pp is None):
        raise ConfigError("--target-tp/--target-pp: give both, or neither for tp 1 x pp 1")
    tp, pp = args.target_tp or 1, args.target_pp or 1
    if tp < 1 or pp < 1:
        raise ConfigError(f"--target-tp {tp} --target-pp {pp}: sizes must be at least 1")
    reader = open_iteration(args.load, args.iteration)
    folder = export_megatron(reader, args.out, tp, pp, progress=_bar("writing torch_dist"))
    return [f"iteration {reader.iteration} written as Megatron-LM torch_dist for tp {tp} x pp {pp}: {folder} "
            "(weights, iteration, consumed samples; Megatron-LM starts a fresh optimizer)"]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if not args.to_megatron and (args.target_tp is not None or args.target_pp is not None):
            raise ConfigError("--target-tp/--target-pp: only with --to-megatron (a Ternion checkpoint loads at any "
                              "layout)")
        lines = to_megatron(args) if args.to_megatron else to_ternion(args)
    except ConfigError as e:
        print(f"convert_megatron.py: error: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Turn a Hugging Face `transformers` model folder into an iteration-0 Ternion checkpoint.

    python tools/convert_hf.py --hf DIR --out SAVE_DIR [--seq-length N] [--tokenizer-type TYPE]

DIR is what `save_pretrained` writes: config.json and model.safetensors, or shards listed in
model.safetensors.index.json. Llama (Llama 3 RoPE scaling included), Mistral and Mixtral (their sliding
window as --window-size), Qwen2 (QKV biases, its windowed layers as --window-attn-skip-freq), Qwen3 and
Qwen3-MoE (per-head QK-norm), OLMo-2 (QK-norm over the whole projection, norms after the sublayers) and GPT-2
are read, one tensor at a time, so memory stays near the largest tensor. SAVE_DIR gets the checkpoint, which
loads at any tp/pp layout, and `model.yaml`, a --config file with the model's flags and its tokenizer (as far
as this build's flags can name it); the flags are also printed. Continue pretraining from it with a fresh
optimizer at iteration 0:

    torchrun ... launch/pretrain_gpt.py --config SAVE_DIR/model.yaml --load SAVE_DIR --finetune --save RUN ...

and export the result with `tools/merge_ckpt.py --load RUN --out DIR --format hf`.
"""
from __future__ import annotations

import argparse
import os
import sys

from engine.checkpoint.hf import import_hf
from engine.cli import OneLineParser
from engine.config import TOKENIZER_TYPES, ConfigError
from engine.flags import command_line
from engine.run.lock import tool_output

CONFIG_FILE = "model.yaml"
FOUND_FIRST = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")  # the order they are looked for


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="convert_hf.py", script="tools/convert_hf.py",
                      description="Convert a transformers Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, OLMo-2 "
                                  "or GPT-2 folder into a Ternion checkpoint (iteration 0) plus a --config file of "
                                  "its flags.")
    p.add_argument("--hf", required=True, help="folder written by save_pretrained (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint directory to create (use it as --load)")
    p.add_argument("--seq-length", type=int, help="the run's --seq-length (default: the model's positions, at most "
                                                   "4096)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                   help="the tokenizer to record (default: found in --hf: tokenizer.model, tokenizer.json, or "
                        "vocab.json + merges.txt)")
    return p.parse_args(argv)


def tokenizer_fields(hf_dir: str, kind=None) -> tuple:
    """(DataConfig fields naming the folder's tokenizer, or {} and a note when it has none)."""
    sp, hf_json, vocab, merges = (os.path.join(os.path.abspath(hf_dir), n)
                                  for n in ("tokenizer.model", "tokenizer.json", "vocab.json", "merges.txt"))
    found = {"SentencePieceTokenizer": os.path.isfile(sp), "HuggingFaceTokenizer": os.path.isfile(hf_json),
             "GPT2BPETokenizer": os.path.isfile(vocab) and os.path.isfile(merges), "NullTokenizer": True}
    fields = {"SentencePieceTokenizer": {"tokenizer_model": sp}, "NullTokenizer": {},
              "HuggingFaceTokenizer": {"tokenizer_model": os.path.dirname(hf_json)},
              "GPT2BPETokenizer": {"vocab_file": vocab, "merge_file": merges}}
    if kind is not None and not found[kind]:
        raise ConfigError(f"--tokenizer-type {kind}: its files are not in {hf_dir}")
    kind = kind or next((k for k in FOUND_FIRST if found[k]), None)
    if kind is None:
        return {}, f"no tokenizer files in {hf_dir}: none recorded"
    return {"tokenizer_type": kind, **fields[kind]}, None


def write_config(path: str, values: dict, hf_dir: str) -> None:
    import yaml
    with open(path, "w") as fh:
        fh.write(f"# The flags of the transformers model in {os.path.abspath(hf_dir)} (tools/convert_hf.py).\n"
                 f"# Continue pretraining: launch/pretrain_gpt.py --config {path} --load {os.path.dirname(path)} "
                 "--finetune --save RUN_DIR ...\n")
        yaml.safe_dump(values, fh, sort_keys=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        data, note = tokenizer_fields(args.hf, args.tokenizer_type)
        with tool_output(args.out):  # not a running job's --save; a read-only or full --out is one line
            cfg, names = import_hf(args.hf, args.out, args.seq_length, data)
            values = {name: getattr(cfg.model, name) for name in names if getattr(cfg.model, name) is not None} | data
            path = os.path.join(args.out, CONFIG_FILE)
            write_config(path, values, args.hf)
    except ConfigError as e:
        print(f"convert_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.hf} into {args.out} (iteration 0; loads at any tp/pp layout)")
    if note:
        print(f"tokenizer: {note}")
    for line in cfg.notices:
        print(f"note: {line}")
    print(f"flags: {command_line(values)}")
    print(f"config: {path} (use --config {path} --load {args.out} --finetune)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

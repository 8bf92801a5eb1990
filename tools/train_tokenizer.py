"""Train a SentencePiece BPE tokenizer on text or JSONL files and print its fertility.

    python tools/train_tokenizer.py --input FILE... --vocab-size N --model-prefix PREFIX

Writes PREFIX.model and PREFIX.vocab. Byte fallback, digits split, special tokens unk 0, bos 1,
eos/eod 2, pad 3. One document in 100 is held out of training; the fertility printed (tokens per
whitespace-separated word) is measured on those. Progress bars with an ETA (stderr; --quiet drops them)
follow the input read and the BPE merges. A key of --json-keys missing from the first record ends it
with one line and exit code 2.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterator, Optional

from engine.cli import OneLineParser
from engine.data.preprocess import check_inputs, is_json_input
from engine.data.tokenizer_training import TrainingProgress, fertility, train_sentencepiece

HOLDOUT_EVERY = 100
HOLDOUT_MAX = 2000


def documents(paths: list[str], keys: list[str], skipped: list[str],
              on_read: Optional[Callable[[int], None]] = None) -> Iterator[str]:
    """Each document: a JSON line's texts under `keys` (.jsonl/.json files) or a line of a text file.

    JSON lines that cannot be read are skipped and recorded in `skipped` as "path:line". `on_read` is
    told the bytes of every line read.
    """
    for path in paths:
        is_json = is_json_input(path)
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if on_read is not None:
                    on_read(len(raw))
                line = raw.decode("utf-8", errors="replace")
                if not line.strip():
                    continue
                if not is_json:
                    yield line.rstrip("\r\n")
                    continue
                try:
                    record = json.loads(line)
                    yield "\n".join(record[k] for k in keys)
                except (ValueError, KeyError, TypeError):
                    skipped.append(f"{path}:{number}")


def split_holdout(docs: Iterator[str], held_out: list[str]) -> Iterator[str]:
    """Training lines of every document but one in HOLDOUT_EVERY, which goes to `held_out`."""
    for i, doc in enumerate(docs):
        if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 and len(held_out) < HOLDOUT_MAX:
            held_out.append(doc)
        else:
            yield from doc.split("\n")


def main(argv=None) -> int:
    p = OneLineParser(prog="train_tokenizer.py", script="tools/train_tokenizer.py",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl/.json (one object per line) or text files")
    p.add_argument("--vocab-size", type=int, required=True, help="vocabulary size (at least 300: 256 bytes + specials)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys holding the text")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="lines sampled for training")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    error = None
    missing = [f for f in args.input if not os.path.isfile(f)]
    if missing:
        error = f"--input {missing[0]}: file not found"
    elif args.vocab_size < 300:
        error = f"--vocab-size {args.vocab_size}: byte fallback needs at least 300 (256 bytes + special tokens + pieces)"
    elif not os.path.isdir(os.path.dirname(os.path.abspath(args.model_prefix))):
        error = f"--model-prefix {args.model_prefix}: its directory does not exist; create it first"
    else:
        error = check_inputs(args.input, args.json_keys)
    if error is None:
        held_out: list[str] = []
        skipped: list[str] = []
        progress = None if args.quiet else TrainingProgress(sum(map(os.path.getsize, args.input)), args.vocab_size)
        docs = documents(args.input, args.json_keys, skipped, progress.read if progress else None)
        try:
            tok = train_sentencepiece(split_holdout(docs, held_out), args.model_prefix, args.vocab_size,
                                      max_sentences=args.max_sentences, progress=progress)
        except RuntimeError as e:
            reason = (progress.errors[-1] if progress and progress.errors else str(e).strip().splitlines()[0])
            error = f"--input {' '.join(args.input)}: SentencePiece could not train on it ({reason})"
    if error:
        print(f"train_tokenizer.py: error: {error}", file=sys.stderr)
        return 2
    if skipped:
        print(f"skipped {len(skipped)} lines that are not JSON objects with string keys "
              f"{', '.join(args.json_keys)} (first: {skipped[0]})")
    print(f"wrote {args.model_prefix}.model and .vocab ({tok.vocab_size} pieces)")
    if held_out:
        print(f"fertility: {fertility(tok, held_out):.3f} tokens per word on {len(held_out)} held-out documents")
    else:
        print("fertility: no held-out documents (fewer than 100 in the input)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokenize JSONL or text into Megatron-LM indexed datasets (PREFIX_KEY_document.bin/.idx).

    python tools/preprocess_data.py --input FILE.jsonl --json-keys text --tokenizer-model FILE.model \\
        --output-prefix PREFIX --workers N --append-eod [--dedup] [--min-words N] [--max-symbol-ratio R]

The tokenizer, with Megatron-LM's flags: --tokenizer-model FILE.model (SentencePiece, the default), --tokenizer-type
GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt, --tokenizer-type HuggingFaceTokenizer
--tokenizer-model tokenizer.json|DIR, or --tokenizer-type NullTokenizer --vocab-size N (text: integer ids).

A key of --json-keys missing from the first record, or an output with no tokens, ends it with one line
and exit code 2 (an empty output is removed). The progress bar (stderr) shows an ETA; --quiet drops it.
"""
from __future__ import annotations

import argparse
import os
import sys

from engine.cli import OneLineParser
from engine.config import TOKENIZER_TYPES, ConfigError
from engine.data.preprocess import Options, check_inputs, preprocess
from engine.data.tokenizer_spec import tokenizer_spec


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="preprocess_data.py", script="tools/preprocess_data.py",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="input files: .jsonl/.json (one JSON object per line) or plain text (one document per line)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one output per key")
    p.add_argument("--tokenizer-model", help="SentencePiece .model (tools/train_tokenizer.py), a tokenizer.json or a "
                                             "transformers tokenizer directory")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                   help="default: implied by the files (SentencePieceTokenizer for a .model file)")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: ids below N are text, N ends a document")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--workers", type=int, default=1, help="encoding processes")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--dedup", action="store_true", help="drop exact duplicates (same text after lower-casing "
                                                        "and collapsing whitespace)")
    p.add_argument("--min-words", type=int, default=0, help="drop documents with fewer whitespace words")
    p.add_argument("--max-symbol-ratio", type=float, default=1.0,
                   help="drop documents where a larger share of characters are symbols (not letters, digits, "
                        "underscore or whitespace)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> str | None:
    """The first user mistake, as one line, or None."""
    for path in args.input:
        if not os.path.isfile(path):
            return f"--input {path}: file not found"
    try:
        args.tokenizer = tokenizer_spec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                        args.vocab_size)
        if args.tokenizer is None:
            return ("--tokenizer-model: no tokenizer given; pass --tokenizer-model FILE.model (or --tokenizer-type "
                    "with its files)")
        if args.vocab_size is not None and args.tokenizer.type != "NullTokenizer":
            return (f"--vocab-size {args.vocab_size}: only --tokenizer-type NullTokenizer reads it; the "
                    f"{args.tokenizer.type} gives the vocabulary")
        tok = args.tokenizer.build()
    except ConfigError as e:
        return str(e)
    if args.append_eod and tok.eod is None:
        return (f"--append-eod: {tok.source} names no end-of-document (eos) token; set eos_token in its "
                "tokenizer_config.json or drop --append-eod")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        return f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist; create it first"
    if args.workers < 1:
        return f"--workers {args.workers}: must be at least 1"
    if args.min_words < 0:
        return f"--min-words {args.min_words}: must be non-negative"
    if not 0 < args.max_symbol_ratio <= 1:
        return f"--max-symbol-ratio {args.max_symbol_ratio}: must be in (0, 1]"
    if len(set(args.json_keys)) != len(args.json_keys):
        return f"--json-keys {' '.join(args.json_keys)}: each key may appear once"
    return check_inputs(args.input, args.json_keys)


def main(argv=None) -> int:
    args = parse_args(argv)
    error = check(args)
    if error:
        print(f"preprocess_data.py: error: {error}", file=sys.stderr)
        return 2
    options = Options(json_keys=tuple(args.json_keys), append_eod=args.append_eod, dedup=args.dedup,
                      min_words=args.min_words, max_symbol_ratio=args.max_symbol_ratio)
    summary = preprocess(args.input, args.tokenizer, args.output_prefix, options,
                         workers=args.workers, progress=not args.quiet)
    if summary.tokens == 0:  # an empty dataset is no result: say why, and leave nothing a run could pick up
        for prefix in summary.outputs:
            for ext in (".bin", ".idx"):
                os.remove(prefix + ext)
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(summary.dropped.items())) or "no text in them"
        print(f"preprocess_data.py: error: no tokens to write: {summary.documents} documents read from "
              f"{' '.join(args.input)}, {summary.kept} kept ({why}); check --input, --json-keys and the filters",
              file=sys.stderr)
        return 2
    print("\n".join(summary.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

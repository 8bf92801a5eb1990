"""A demo corpus that needs no download: the Python standard library's own source files.

`build_demo_corpus(out_dir)` picks up to `max_files` .py files of the running interpreter's standard
library (third-party site-packages and the test suites left out), trains a small SentencePiece
tokenizer on them and writes them, one document per file, as an indexed dataset. A stamp file records
what was built; a later call with the same arguments returns at once.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig

from engine.data.preprocess import Options, output_prefix, preprocess
from engine.data.tokenizer_training import train_sentencepiece

MAX_FILE_BYTES = 200_000  # a few generated files (e.g. pydoc topics) would dominate a small corpus
# Tests and third-party packages are not the stdlib's prose; the codec tables in encodings/ are mostly
# hex literals and would teach a tiny model little else.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
CORPUS_VERSION = 2  # bump when the file selection changes, so cached corpora are rebuilt


def stdlib_sources(max_files: int) -> list[str]:
    """Up to max_files standard-library sources, spread evenly over the sorted list of all of them."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(directory, name)
            if name.endswith(".py") and 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
                found.append(path)
    if len(found) <= max_files:
        return found
    step = len(found) / max_files
    return [found[int(i * step)] for i in range(max_files)]


def build_demo_corpus(out_dir: str, vocab_size: int = 4096, max_files: int = 1000,
                      workers: int | None = None) -> tuple[str, str]:
    """-> (tokenizer model path, data prefix); builds under out_dir on the first call only."""
    os.makedirs(out_dir, exist_ok=True)
    model_prefix = os.path.join(out_dir, f"stdlib-bpe{vocab_size}")
    data_prefix = output_prefix(os.path.join(out_dir, f"stdlib-{max_files}"), "text")
    stamp = os.path.join(out_dir, f"stdlib-{max_files}-bpe{vocab_size}.json")
    wanted = {"python": sys.version.split()[0], "vocab_size": vocab_size, "max_files": max_files,
              "version": CORPUS_VERSION}
    if _stamp_matches(stamp, wanted):
        return model_prefix + ".model", data_prefix

    sources = stdlib_sources(max_files)
    corpus = os.path.join(out_dir, f"stdlib-{max_files}.jsonl")
    texts = []
    with open(corpus, "w", encoding="utf-8") as f:
        for path in sources:
            with open(path, encoding="utf-8", errors="replace") as src:
                text = src.read()
            texts.append(text)
            f.write(json.dumps({"text": text}) + "\n")
    lines = (line for text in texts for line in text.split("\n"))
    train_sentencepiece(lines, model_prefix, vocab_size)
    summary = preprocess([corpus], model_prefix + ".model", os.path.join(out_dir, f"stdlib-{max_files}"),
                         Options(append_eod=True), workers=workers or min(2, os.cpu_count() or 1), progress=False)
    os.remove(corpus)
    tmp = stamp + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**wanted, "documents": summary.kept, "tokens": summary.tokens}, f)
    os.replace(tmp, stamp)
    return model_prefix + ".model", data_prefix


def _stamp_matches(stamp: str, wanted: dict) -> bool:
    try:
        with open(stamp) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return False
    return all(recorded.get(k) == v for k, v in wanted.items())

"""Text or JSONL in, tokenized documents out as MMIDIDX datasets (PREFIX_KEY_document.bin/.idx).

The main process reads lines and writes the output in input order; worker processes parse, filter and
encode chunks of lines, so the encoding (the expensive part) runs on every worker at once. Optional
steps, each counted in the summary:
- exact de-duplication: a document whose normalised text (lower case, whitespace collapsed) hashes
  like an earlier one is dropped;
- quality filters: fewer than `min_words` whitespace words, or more than `max_symbol_ratio` of its
  characters neither letters, digits, underscore nor whitespace.
Input files ending in .jsonl or .json hold one JSON object per line (the texts under `json_keys`);
any other file is plain text with one document per line. `check_inputs` refuses, before any work, an
input whose first record lacks a key (both tools call it); a progress bar with an ETA follows the input
bytes read.
The tokenizer is any `--tokenizer-type` (engine.data.tokenizer_spec.TokenizerSpec, rebuilt in every worker); a
document it cannot encode (a NullTokenizer's text that is not integer ids) is dropped and counted.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from engine.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from engine.data.tokenizer_spec import TokenizerSpec, tokenizer_spec

# Work is handed to workers in chunks of at most this many lines or bytes: large enough to amortise
# the inter-process traffic, small enough to keep every worker busy until the end.
CHUNK_LINES = 256
CHUNK_BYTES = 256 * 1024
_SYMBOL = re.compile(r"[^\w\s]")


@dataclass
class Options:
    json_keys: Sequence[str] = ("text",)
    append_eod: bool = False
    dedup: bool = False
    min_words: int = 0
    max_symbol_ratio: float = 1.0


@dataclass
class Summary:
    documents: int = 0
    kept: int = 0
    tokens: int = 0
    seconds: float = 0.0
    dropped: Counter = field(default_factory=Counter)
    outputs: list = field(default_factory=list)

    def lines(self) -> list[str]:
        rate = self.documents / max(self.seconds, 1e-9)
        out = [f"read {self.documents} documents, kept {self.kept}, {self.tokens} tokens in {self.seconds:.1f} s "
               f"({rate:.0f} documents/s, {self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)"]
        out += [f"dropped {n}: {reason}" for reason, n in sorted(self.dropped.items())]
        out += [f"wrote {prefix}.bin/.idx" for prefix in self.outputs]
        return out


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def is_json_input(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def check_inputs(paths: Sequence[str], keys: Sequence[str]) -> Optional[str]:
    """The first problem of the inputs as one line, or None: every file must hold text, and in a .jsonl/.json
    file the first JSON object must hold a string under each key (later lines that do not are dropped
    and counted, as before)."""
    for path in paths:
        record = _first_record(path)
        if record is None:
            return f"--input {path}: the file holds no text"
        if not is_json_input(path):
            continue
        if not isinstance(record, dict):
            return (f"--input {path}: no line is a JSON object; give one object per line, or name a plain-text "
                    "file other than .json/.jsonl")
        for key in keys:
            if key not in record:
                present = ", ".join(map(repr, record)) or "none"
                return (f"--json-keys {' '.join(keys)}: the first record of {path} has no key {key!r} "
                        f"(its keys: {present})")
            if not isinstance(record[key], str):
                return (f"--json-keys {' '.join(keys)}: key {key!r} in the first record of {path} holds "
                        f"{str(record[key])[:40]!r} ({type(record[key]).__name__}), not a string")
    return None


def _first_record(path: str):
    """The first JSON object of a .jsonl/.json file (else its first non-blank line, or True for a text file
    with one); None when the file holds no non-blank line."""
    found = None
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            if not is_json_input(path):
                return True
            try:
                record = json.loads(line)
            except ValueError:
                record = line
            if isinstance(record, dict):
                return record
            found = record if found is None else found
    return found


def preprocess(inputs: Sequence[str], tokenizer_model, prefix: str, options: Options,
               workers: int = 1, progress: bool = True) -> Summary:
    """Tokenize every document of `inputs` into one dataset per JSON key; returns the counts. `tokenizer_model`
    is a TokenizerSpec or the path of a tokenizer file (its type implied: a .model file is SentencePiece)."""
    spec = tokenizer_model if isinstance(tokenizer_model, TokenizerSpec) else tokenizer_spec(None, tokenizer_model)
    tokenizer = spec.build()
    if options.append_eod and tokenizer.eod is None:
        raise ValueError(f"{tokenizer.source}: the tokenizer has no end-of-document token for append_eod")
    dtype = token_dtype(tokenizer.vocab_size)
    summary = Summary()
    writers = {k: IndexedDatasetWriter(output_prefix(prefix, k), dtype) for k in options.json_keys}
    seen: set[bytes] = set()
    bar = tqdm(total=sum(os.path.getsize(p) for p in inputs), unit="B", unit_scale=True, unit_divisor=1024,
               desc="tokenizing", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    # fork starts workers in milliseconds and they touch nothing but the tokenizer; macOS lacks a safe fork.
    ctx = mp.get_context("spawn" if sys.platform == "darwin" else "fork")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec, options, dtype.str)) as pool:
        for chunk in pool.imap(_encode_chunk, _chunks(inputs), chunksize=1):
            nbytes, docs, dropped = chunk
            summary.documents += len(docs) + sum(dropped.values())
            summary.dropped.update(dropped)
            for digest, per_key in docs:
                if options.dedup:
                    if digest in seen:
                        summary.dropped["duplicate"] += 1
                        continue
                    seen.add(digest)
                summary.kept += 1
                for key, (data, length) in zip(options.json_keys, per_key):
                    writers[key].add_raw(data, (length,))
                    summary.tokens += length
            bar.set_postfix_str(f"{summary.documents:,} documents, {summary.tokens:,} tokens", refresh=False)
            bar.update(nbytes)
        # the workers told to finish and waited for. Leaving the block with them alive ends them by SIGTERM: the
        # pool's shutdown takes the task queue's lock, a worker waiting for it must be killed, and where this
        # process has a SIGTERM handler that does not exit (its forks inherit it) that wait never ends
        pool.close()
        pool.join()
    for key, writer in writers.items():
        writer.finalize()
        summary.outputs.append(writer.prefix)
    summary.seconds = time.perf_counter() - start
    bar.close()
    return summary


def _chunks(inputs: Sequence[str]) -> Iterator[tuple[bool, list[bytes]]]:
    """(is_jsonl, lines) in chunks of CHUNK_LINES lines or CHUNK_BYTES bytes, file by file."""
    for path in inputs:
        is_json = is_json_input(path)
        with open(path, "rb") as f:
            lines, size = [], 0
            for line in f:
                lines.append(line)
                size += len(line)
                if len(lines) == CHUNK_LINES or size >= CHUNK_BYTES:
                    yield is_json, lines
                    lines, size = [], 0
            if lines:
                yield is_json, lines


_worker: dict = {}


def _init_worker(spec: TokenizerSpec, options: Options, dtype: str) -> None:
    # One thread per worker for the Rust tokenizers too: the parallelism is the workers'.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=spec.build(), options=options, dtype=np.dtype(dtype))


def _encode_chunk(job: tuple[bool, list[bytes]]):
    """-> (bytes read, [(digest, [(token bytes, length) per key])], Counter of drop reasons)."""
    is_json, lines = job
    tok, opt, dtype = _worker["tokenizer"], _worker["options"], _worker["dtype"]
    dropped: Counter = Counter()
    kept_texts: list[list[str]] = []
    for line in lines:
        if not line.strip():
            continue
        if is_json:
            try:
                record = json.loads(line)
                texts = [record[k] for k in opt.json_keys]
            except (ValueError, KeyError, TypeError):
                dropped["malformed JSON or missing key"] += 1
                continue
            if not all(isinstance(t, str) for t in texts):
                dropped["malformed JSON or missing key"] += 1
                continue
        else:
            texts = [line.decode("utf-8", errors="replace").rstrip("\r\n")]
        reason = _rejected(texts, opt)
        if reason:
            dropped[reason] += 1
            continue
        kept_texts.append(texts)
    docs = []
    per_key = [_encode_all(tok, [t[k] for t in kept_texts]) for k in range(len(opt.json_keys))]
    for d, texts in enumerate(kept_texts):
        refused = next((ids for ids in (per_key[k][d] for k in range(len(texts))) if isinstance(ids, str)), None)
        if refused:
            dropped[refused] += 1
            continue
        digest = _digest(texts) if opt.dedup else None
        encoded = []
        for ids in (per_key[k][d] for k in range(len(texts))):
            if opt.append_eod:
                ids.append(tok.eod)
            encoded.append((np.asarray(ids, dtype=dtype).tobytes(), len(ids)))
        docs.append((digest, encoded))
    return sum(map(len, lines)), docs, dropped


def _encode_all(tok, texts: list[str]) -> list:
    """Each text's ids; where the tokenizer refuses a text (ValueError), the reason instead."""
    try:
        return tok.encode_batch(texts)
    except ValueError:
        out = []
        for text in texts:
            try:
                out.append(tok.encode(text))
            except ValueError as e:
                out.append(str(e) or "the tokenizer refused it")
        return out


def _rejected(texts: list[str], opt: Options) -> Optional[str]:
    if opt.min_words and sum(len(t.split()) for t in texts) < opt.min_words:
        return f"fewer than {opt.min_words} words"
    if opt.max_symbol_ratio < 1.0:
        chars = sum(map(len, texts))
        symbols = sum(len(t) - len(_SYMBOL.sub("", t)) for t in texts)
        if chars and symbols / chars > opt.max_symbol_ratio:
            return f"symbol ratio above {opt.max_symbol_ratio}"
    return None


def _digest(texts: list[str]) -> bytes:
    normalised = "\x00".join(" ".join(t.lower().split()) for t in texts)
    return hashlib.blake2b(normalised.encode("utf-8"), digest_size=16).digest()

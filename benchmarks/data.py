"""Data pipeline benchmarks: sample-index building for 1M documents, and preprocessing throughput.

    python benchmarks/data.py [--documents 1000000] [--seq-length 2048] [--files 300]

1. Index building: document, sample and shuffle indices of a GPTDataset over synthetic documents
   (log-normal lengths, median about 400 tokens) in Megatron-LM's order, for one epoch and for 2.5
   (epochs shuffled together, the half-used last one apart); and a phased 3-way blend over one epoch's
   samples (Megatron's interleave, a Python loop).
2. Preprocessing: tokens/s of tools/preprocess_data.py's pipeline (JSON parsing, encoding, writing)
   with N workers against raw SentencePiece encoding of the same texts in N processes, same run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import runpy
import tempfile
import time

import numpy as np

from engine.data.blend import blend_indices
from engine.data.gpt_dataset import build_indices
from engine.data.preprocess import Options, preprocess
from engine.data.tokenizer import Tokenizer

# The demo corpus builder is one of the tools (scripts, not an installed package): loaded by path.
_demo_corpus = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                                           "demo_corpus.py"))
build_demo_corpus, stdlib_sources = _demo_corpus["build_demo_corpus"], _demo_corpus["stdlib_sources"]


def bench_index(num_docs: int, seq_length: int) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, size=num_docs), 1, 60_000).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    for epochs in (1, 2.5):
        start = time.perf_counter()
        doc, sample, shuffle = build_indices(lengths, np.arange(num_docs), seq_length, int(num_samples * epochs),
                                             seed=1234)
        took = time.perf_counter() - start
        print(f"index build: {num_docs:,} documents, {tokens:,} tokens, {epochs:g} epoch(s) -> {len(shuffle):,} "
              f"samples of {seq_length} in {took:.3f} s")
    start = time.perf_counter()
    blend_indices([(0, [0.5, 0.3, 0.2]), (num_samples // 2, [0.2, 0.3, 0.5])], num_samples)
    print(f"blend index: 3 sources, 2 phases, {num_samples:,} samples in {time.perf_counter() - start:.3f} s")



def bench_preprocess(num_files: int, workdir: str) -> None:
    model, _ = build_demo_corpus(os.path.join(workdir, "demo"), vocab_size=4096, max_files=num_files)
    texts = []
    for path in stdlib_sources(num_files):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    corpus = os.path.join(workdir, "bench.jsonl")
    with open(corpus, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    mb = sum(map(len, texts)) / 1e6

    for workers in sorted({1, min(2, os.cpu_count() or 1), os.cpu_count() or 1}):
        raw = raw_encoding_rate(model, texts, workers)
        summary = preprocess([corpus], model, os.path.join(workdir, f"bench{workers}"), Options(append_eod=True),
                             workers=workers, progress=False)
        rate = summary.tokens / summary.seconds
        print(f"{workers} process(es), {len(texts)} documents ({mb:.1f} MB): raw SentencePiece encoding "
              f"{raw:,.0f} tokens/s, preprocess_data {rate:,.0f} tokens/s "
              f"({summary.documents / summary.seconds:,.0f} documents/s): {rate / raw:.2f} of raw per worker")


def _encode_part(job: tuple[str, list[str]]) -> int:
    model, texts = job
    tok = Tokenizer(model)
    return sum(len(tok.encode(t)) for t in texts)


def raw_encoding_rate(model: str, texts: list[str], processes: int) -> float:
    """Tokens/s of plain `encode` calls over the texts, split across `processes` (the same machine
    share the preprocessing workers get, so the ratio is per worker whatever the core count)."""
    parts = [(model, texts[i::processes]) for i in range(processes)]
    with mp.get_context("fork").Pool(processes) as pool:
        pool.map(_encode_part, [(model, texts[:1])] * processes)  # start-up and model load not timed
        start = time.perf_counter()
        tokens = sum(pool.map(_encode_part, parts))
        return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--files", type=int, default=300, help="standard-library files to preprocess")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} CPU cores")
    with tempfile.TemporaryDirectory() as workdir:
        bench_index(args.documents, args.seq_length)
        bench_preprocess(args.files, workdir)


if __name__ == "__main__":
    main()

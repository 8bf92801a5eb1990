"""Training a SentencePiece BPE tokenizer with the settings tokenizer.py describes, and measuring its fit.

`train_sentencepiece` writes MODEL_PREFIX.model/.vocab and returns the engine's `Tokenizer` for it;
`TrainingProgress` shows two progress bars with an ETA (tqdm): the input read, then the BPE merges, the
latter following SentencePiece's own log; `fertility` is tokens per whitespace-separated word.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from typing import Iterable, Iterator, Optional

import sentencepiece as spm
from tqdm import tqdm

from engine.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer


def train_sentencepiece(sentences: Iterable[str], model_prefix: str, vocab_size: int,
                        max_sentences: int = 2_000_000, num_threads: int | None = None,
                        progress: Optional["TrainingProgress"] = None) -> Tokenizer:
    """Train a BPE model on `sentences` (lines of text); writes MODEL_PREFIX.model and .vocab.

    The vocabulary may come out smaller than asked when the text is too small to fill it. With `progress`,
    SentencePiece logs what it does and the merges bar follows that log.
    """
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    if progress is None:
        _train(sentences, model_prefix, vocab_size, max_sentences, num_threads, log_level=2)
    else:
        with progress:
            _train(sentences, model_prefix, vocab_size, max_sentences, num_threads, log_level=0)
    return Tokenizer(model_prefix + ".model")


def _train(sentences, model_prefix: str, vocab_size: int, max_sentences: int, num_threads, log_level: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_non_empty(sentences),
        model_prefix=model_prefix,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=16384,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=log_level,
    )


class TrainingProgress:
    """Progress bars with an ETA for `train_sentencepiece`: the input read, then the BPE merges.

    The caller reports input bytes with `read(n)` as it hands lines over. SentencePiece logs from C++ to
    the process's stderr, so while it trains file descriptor 2 points at a temporary file that a thread
    follows: its merge counts drive the second bar (the merges needed are the vocabulary less the 256
    byte pieces, the 4 special tokens and the alphabet it reports), its error lines are kept in `errors`,
    the rest is dropped. The bars write to the real stderr.
    """

    # Merges done so far: every 100 in sentencepiece 0.2 ("merges=N"; 0.1: "size=N all=") and at the end.
    _MERGES = re.compile(rb"\bmerges=(\d+)|\bsize=(\d+) all=|Completed (\d+) merge steps")
    _ALPHABET = re.compile(rb"Alphabet size=(\d+)")

    def __init__(self, input_bytes: int, vocab_size: int):
        self.input_bytes, self.vocab_size = input_bytes, vocab_size
        self.errors: list[str] = []
        self.stream = sys.stderr
        self._reading = self._merging = None
        self._alphabet = 0
        self._lock = threading.Lock()

    def read(self, nbytes: int) -> None:
        with self._lock:
            if self._reading is None and self._merging is None:
                self._reading = tqdm(total=self.input_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                                     desc="reading input", file=self.stream, dynamic_ncols=True)
            if self._reading is not None:
                self._reading.update(nbytes)

    def __enter__(self) -> "TrainingProgress":
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self.stream = os.fdopen(os.dup(self._saved_fd), "w", buffering=1)
        self._log = tempfile.TemporaryFile()
        os.dup2(self._log.fileno(), 2)
        self._offset, self._partial = 0, b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._poll()
        with self._lock:
            for bar in (self._reading, self._merging):
                if bar is not None:
                    bar.close()
        self._log.close()
        self.stream.close()
        self.stream = sys.stderr

    def _follow(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def _poll(self) -> None:
        data = os.pread(self._log.fileno(), 1 << 20, self._offset)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        if re.match(rb"[EF]\d{4} ", line) or b"ERROR" in line or b"FATAL" in line:
            self.errors.append(line.decode("utf-8", "replace").split("] ", 1)[-1].strip())
        alphabet, merges = self._ALPHABET.search(line), self._MERGES.search(line)
        if alphabet:
            self._alphabet = int(alphabet.group(1))
        if merges:
            done = int(next(g for g in merges.groups() if g))
            with self._lock:
                if self._reading is not None:
                    self._reading.close()
                    self._reading = None
                if self._merging is None:
                    total = max(self.vocab_size - 256 - 4 - self._alphabet, done)
                    self._merging = tqdm(total=total, initial=done, unit=" merges", desc="BPE merges",
                                         file=self.stream, dynamic_ncols=True)
                self._merging.update(done - self._merging.n)


def _non_empty(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        if line.strip():
            yield line


def fertility(tokenizer: Tokenizer, texts: Iterable[str]) -> float:
    """Tokens per whitespace-separated word over `texts` (lower is a better fit to the text)."""
    tokens = words = 0
    for text in texts:
        tokens += len(tokenizer.encode(text))
        words += len(text.split())
    return tokens / max(words, 1)

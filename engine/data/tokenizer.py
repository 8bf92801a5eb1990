"""SentencePiece BPE tokenizer: training it, and the small wrapper the engine encodes and decodes with.

Training settings follow what makes a tokenizer lossless for pretraining: byte fallback (no unknown
text), digits split one per token, no text normalisation and no whitespace collapsing (so source code
round-trips), and fixed ids for the special tokens: unk 0, bos 1, eos (= end of document) 2, pad 3.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import sentencepiece as spm

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class Tokenizer:
    """`encode(text) -> list[int]`, `decode(ids) -> str`; `.vocab_size`, `.eod`, `.bos`, `.pad`."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"{model_path} not found; train one with tools/train_tokenizer.py")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos = self.sp.bos_id()
        self.eod = self.sp.eos_id()
        self.pad = self.sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from worker processes, and a fair per-worker figure needs it.
        return self.sp.encode(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def train_sentencepiece(sentences: Iterable[str], model_prefix: str, vocab_size: int,
                        max_sentences: int = 2_000_000, num_threads: int | None = None) -> Tokenizer:
    """Train a BPE model on `sentences` (lines of text); writes MODEL_PREFIX.model and .vocab.

    The vocabulary may come out smaller than asked when the text is too small to fill it.
    """
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
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
        minloglevel=2,
    )
    return Tokenizer(model_prefix + ".model")


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

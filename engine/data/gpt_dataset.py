"""GPT training samples: seq_length + 1 tokens cut from documents packed end to end.

Documents (which end in EOD when preprocessed with --append-eod) are laid out one after another in a
shuffled order, a fresh order per epoch, and the stream is cut every seq_length tokens; sample i is
stream[i*seq_length : (i+1)*seq_length + 1], so consecutive samples share one boundary token and the
model sees every token as a target once. Three index arrays describe this (the scheme of Megatron-LM's
GPTDataset, built here with vectorised numpy):
- document index: the document order over all epochs;
- sample index: for each cut, (position in the document index, token offset in that document);
- shuffle index: the order samples are served in. The last, partial epoch is shuffled on its own and
  served after all full epochs, so no document comes round again before every other one has.
The arrays are cached as .npy files under `cache/` beside the data, named by a hash of everything they
depend on, so every rank and every later run loads them instead of rebuilding.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from engine.data.indexed_dataset import IndexedDataset

_INDEX_VERSION = 1


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """'969,30,1' -> [(start, end)] document ranges for train, valid, test (contiguous, in order)."""
    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected comma-separated numbers such as 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative numbers (train,valid,test) with a positive sum")
    weights += [0.0] * (3 - len(weights))
    bounds = np.round(np.cumsum([0.0] + weights) / sum(weights) * num_documents).astype(np.int64)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def build_indices(sequence_lengths: np.ndarray, sequences: np.ndarray, seq_length: int,
                  num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) giving at least `num_samples` samples.

    `sequences` are the ids of the sequences (documents) this dataset draws from.
    """
    lengths = sequence_lengths[sequences].astype(np.int64)
    tokens_per_epoch = int(lengths.sum())
    if tokens_per_epoch <= 1:
        raise ValueError("the selected documents hold no tokens to train on")
    need = num_samples * seq_length + 1
    epochs = max(1, -(-need // tokens_per_epoch))
    rng = np.random.RandomState(seed % 2**32)
    doc_index = np.concatenate([rng.permutation(sequences) for _ in range(epochs)]).astype(np.int64)

    doc_lengths = sequence_lengths[doc_index].astype(np.int64)
    ends = np.cumsum(doc_lengths)
    starts_of_docs = ends - doc_lengths
    total = int(ends[-1])
    n = (total - 1) // seq_length
    cuts = np.arange(n + 1, dtype=np.int64) * seq_length
    # The document holding each cut is the last one starting at or before it (empty ones are skipped).
    doc_pos = np.searchsorted(starts_of_docs, cuts, side="right") - 1
    sample_index = np.stack([doc_pos, cuts - starts_of_docs[doc_pos]], axis=1)

    full = 0 if epochs == 1 else ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    shuffle_index = np.concatenate([rng.permutation(full), full + rng.permutation(n - full)]).astype(np.int64)
    return doc_index, sample_index, shuffle_index



class GPTDataset:
    """`ds[i]` -> np.int64 array of seq_length + 1 tokens; deterministic for (data, documents, seed).

    `documents` is the range [first, end) of document ids this split draws from; len(ds) may exceed
    `num_samples` (the rest of the last epoch's cuts).
    """

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | None = None):
        self.indexed = indexed
        self.seq_length = seq_length
        first, last = (int(indexed.document_indices[d]) for d in documents)
        sequences = np.arange(first, last, dtype=np.int64)
        key = {
            "version": _INDEX_VERSION, "data": os.path.basename(indexed.prefix),
            "sequences": len(indexed), "tokens": indexed.num_tokens, "range": [first, last],
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
        }
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache")
        stem = os.path.join(cache_dir, f"{key['data']}-{digest}")
        arrays = _load(stem)
        if arrays is None:
            arrays = build_indices(indexed.sequence_lengths, sequences, seq_length, num_samples, seed)
            _save(stem, arrays)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        doc = self.document_index
        if d0 == d1:
            return self.indexed.get(int(doc[d0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        parts = [self.indexed.get(int(doc[d0]), int(o0))]
        parts += [self.indexed.get(int(doc[d])) for d in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(doc[d1]), 0, int(o1 + 1)))
        return np.concatenate(parts).astype(np.int64)


_NAMES = ("document_index", "sample_index", "shuffle_index")


def _load(stem: str):
    try:
        return tuple(np.load(f"{stem}-{name}.npy", mmap_mode="r") for name in _NAMES)
    except (OSError, ValueError):
        return None


def _save(stem: str, arrays) -> None:
    """Write each array to a temporary name and rename it into place: ranks racing here are harmless.

    A read-only data directory only costs the rebuild next time, so failures to write are ignored.
    """
    tmp = None
    try:
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        for name, array in zip(_NAMES, arrays):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(stem), suffix=".npy")
            with os.fdopen(fd, "wb") as f:
                np.save(f, array)
            os.replace(tmp, f"{stem}-{name}.npy")
            tmp = None
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)

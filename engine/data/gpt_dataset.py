"""GPT training samples: seq_length + 1 tokens cut from documents packed end to end, in Megatron-LM's order.

Documents (which end in EOD when preprocessed with --append-eod) are laid out one after another in a
shuffled order and the stream is cut every seq_length tokens; sample i is
stream[i*seq_length : (i+1)*seq_length + 1], so consecutive samples share one boundary token and the
model sees every token as a target once. Three index arrays describe this, and each equals the one
megatron-core's GPTDataset builds for the same files, split, seed, sequence length and sample count
(tests/test_megatron_data.py compares them), so a Megatron-LM run's data order carries over:
- document index: the sequence ids of every epoch the samples need, shuffled together by one
  numpy RandomState(seed) -- except that a last epoch used for less than 80% of its samples is
  shuffled on its own and placed after the others ("separate final epoch"), so that the little of it
  that is read is not drawn from a mix of all epochs;
- sample index: for each cut, (position in the document index, token offset in that document); built
  here with vectorised numpy (Megatron builds it with a C++ loop);
- shuffle index: the order samples are served in, a permutation of all cuts from the same RandomState
  -- in two parts when the final epoch is separate: the cuts before it, then its own.
The split into train, valid and test is over the file's sequences, with Megatron's boundaries (the
shares normalised, summed in order and multiplied out, then rounded half to even).
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

_INDEX_VERSION = 2  # 2: Megatron-LM's order (epochs shuffled together, separate final epoch, its split)
# A last epoch of which fewer than this share of samples are used is shuffled apart (Megatron-LM's threshold).
SEPARATE_FINAL_EPOCH_BELOW = 0.80


def split_ranges(split: str, num_sequences: int) -> list[tuple[int, int]]:
    """'969,30,1' -> [(start, end)] sequence ranges for train, valid, test (contiguous, in order).

    The boundaries are Megatron-LM's: the weights divided by their sum, added up in order, each partial
    sum times the sequence count rounded half to even (Python's round), so .5 ties and float sums land
    where Megatron puts them. A split of weight 0 is an empty range.
    """
    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected comma-separated numbers such as 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative numbers (train,valid,test) with a positive sum")
    weights += [0.0] * (3 - len(weights))
    shares = (np.asarray(weights, dtype=np.float64) / np.sum(np.asarray(weights, dtype=np.float64))).tolist()
    edges = [0.0]
    for share in shares:
        edges.append(edges[-1] + share)
    bounds = [int(round(edge * float(num_sequences))) for edge in edges]
    return [(bounds[i], bounds[i] if shares[i] == 0 else bounds[i + 1]) for i in range(3)]


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs over the documents needed for `num_samples` samples of seq_length + 1 tokens (at least 1)."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    """Megatron-LM's rule: the last of several epochs is shuffled apart when under 80% of its samples are used."""
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    if epochs == 1:
        return False
    before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_last < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)


def build_indices(sequence_lengths: np.ndarray, sequences: np.ndarray, seq_length: int,
                  num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) giving at least `num_samples` samples.

    `sequences` are the ids of the sequences this dataset draws from, in order; `sequence_lengths` are
    the whole file's. The three arrays, their dtypes included, are megatron-core's GPTDataset indices.
    """
    sequences = np.asarray(sequences)
    tokens_per_epoch = int(sequence_lengths[sequences].sum(dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError("the selected documents hold no tokens to train on")
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate = separate_final_epoch(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed % 2**32)
    ids = sequences.astype(np.int32 if len(sequence_lengths) <= np.iinfo(np.int32).max else np.int64)
    if separate:  # all but the last epoch shuffled together, then the last one on its own, from one stream
        doc_index = np.concatenate([_shuffled(np.tile(ids, epochs - 1), rng), _shuffled(ids.copy(), rng)])
    else:
        doc_index = _shuffled(np.tile(ids, epochs), rng)

    sample_index = _sample_index(sequence_lengths, doc_index, seq_length, epochs * tokens_per_epoch)
    n = len(sample_index) - 1
    dtype = np.uint32 if n < np.iinfo(np.uint32).max - 1 else np.int64
    first = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else n
    shuffle_index = _shuffled(np.arange(first, dtype=dtype), rng)
    if separate:
        shuffle_index = np.concatenate([shuffle_index, _shuffled(np.arange(first, n, dtype=dtype), rng)])
    return doc_index, sample_index, shuffle_index


def _shuffled(array: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    rng.shuffle(array)  # in place; the draws depend only on the length, so the order is Megatron's
    return array


def _sample_index(sequence_lengths: np.ndarray, doc_index: np.ndarray, seq_length: int, num_tokens: int) -> np.ndarray:
    """[(position in doc_index, offset)] of every cut k * seq_length of the packed stream, k = 0 .. n.

    Cut k (k >= 1) lies in the document that holds stream position k * seq_length -- the first whose end
    is past it, so empty documents are stepped over -- and the first cut is (0, 0). n is the number of
    whole samples of seq_length + 1 tokens in `num_tokens`. The dtype is int32 unless the positions or
    lengths need int64, as in Megatron.
    """
    n = (num_tokens - 1) // seq_length
    lengths = sequence_lengths[doc_index].astype(np.int64)
    ends = np.cumsum(lengths)
    # Document d holds the cuts k with k * seq_length < end_d, past those of the documents before it: the
    # count of cuts below each end, differenced, repeats each position once per cut it holds (one pass).
    below = (ends - 1) // seq_length + 1
    position = np.repeat(np.arange(len(doc_index), dtype=np.int64), np.diff(below, prepend=0))[1:n + 1]
    offset = np.arange(1, n + 1, dtype=np.int64) * seq_length - (ends[position] - lengths[position])
    largest = max(len(doc_index), int(sequence_lengths.max(initial=0)))
    index = np.zeros((n + 1, 2), dtype=np.int32 if largest <= np.iinfo(np.int32).max else np.int64)
    index[1:, 0] = position
    index[1:, 1] = offset
    return index


class GPTDataset:
    """`ds[i]` -> np.int64 array of seq_length + 1 tokens; deterministic for (data, sequences, seed).

    `sequences` is the range [first, end) of sequence ids this split draws from (split_ranges; one
    sequence per document in files that tools/preprocess_data.py writes); len(ds) may exceed
    `num_samples` (the rest of the last epoch's cuts).
    """

    def __init__(self, indexed: IndexedDataset, sequences: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | None = None):
        self.indexed = indexed
        self.seq_length = seq_length
        first, last = (int(x) for x in sequences)
        sequences = np.arange(first, last, dtype=np.int64)
        key = {
            "version": _INDEX_VERSION, "data": os.path.basename(indexed.prefix),
            "sequences": len(indexed), "tokens": indexed.num_tokens, "range": [first, last],
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
        }
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache")
        stem = os.path.join(cache_dir, f"{key['data']}-{digest}")
        self.document_index, self.sample_index, self.shuffle_index = cached_arrays(
            stem, _NAMES, lambda: build_indices(indexed.sequence_lengths, sequences, seq_length, num_samples, seed))

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


def cached_arrays(stem: str, names: tuple, build) -> tuple:
    """The arrays saved as `{stem}-{name}.npy`, or `build()`'s, saved there for next time."""
    arrays = _load(stem, names)
    if arrays is None:
        arrays = build()
        _save(stem, arrays, names)
    return arrays


def _load(stem: str, names: tuple = _NAMES):
    try:
        return tuple(np.load(f"{stem}-{name}.npy", mmap_mode="r") for name in names)
    except (OSError, ValueError):
        return None


def _save(stem: str, arrays, names: tuple = _NAMES) -> None:
    """Write each array to a temporary name and rename it into place: ranks racing here are harmless.

    A read-only data directory only costs the rebuild next time, so failures to write are ignored.
    """
    tmp = None
    try:
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        for name, array in zip(names, arrays):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(stem), suffix=".npy")
            with os.fdopen(fd, "wb") as f:
                np.save(f, array)
            os.replace(tmp, f"{stem}-{name}.npy")
            tmp = None
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)

"""Megatron-LM's memory-mapped indexed dataset (MMIDIDX, version 1), read and written byte for byte.

A dataset is two files that share a prefix:
- PREFIX.bin: every sequence's tokens, concatenated, in one dtype.
- PREFIX.idx: the 9-byte magic b"MMIDIDX\\x00\\x00", then little-endian <Q version (1), <B dtype code,
  <Q sequence count, <Q document count, then int32 sequence lengths, int64 byte offsets of each
  sequence in .bin, and int64 document indices (document count entries: 0 first, then the sequence
  index at which each document ends).
This layout is the one Megatron-LM's megatron/core/datasets/indexed_dataset.py reads and writes, so
files move between the two projects unchanged. Here each document is one sequence.

Both files are memory-mapped: opening a dataset of any size reads nothing until a sequence is asked for.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1

# Megatron-LM's dtype codes.
DTYPE_CODES = {
    np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
    np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-LM picks for a vocabulary: uint16 below 65,500 entries, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDataset:
    """Read-only view of PREFIX.bin/.idx: `ds[i]` is sequence i as a numpy array (a view of the map)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found; give the prefix without .bin/.idx, "
                                        "as written by tools/preprocess_data.py")
        with open(idx_path, "rb") as f:
            header = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(header) < 34 or header[:9] != MAGIC:
            raise ValueError(f"{idx_path} is not an MMIDIDX index (bad magic)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != VERSION or code not in CODE_DTYPES:
            raise ValueError(f"{idx_path}: unsupported version {version} or dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = len(header)
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, offset)
        # np.memmap refuses empty files; a dataset of empty documents has an empty .bin.
        size = os.path.getsize(bin_path)
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (to its end when length is None)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.prefix}")
        full = int(self.sequence_lengths[i])
        if length is None:
            length = full - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def token_range(self) -> tuple[int, int]:
        """(the smallest token id if it is negative else 0, the largest id) in PREFIX.bin; (0, -1) for no tokens.

        One pass over the file in blocks (a few GB/s once it is in the page cache), done once: the answer
        is kept in `cache/` beside the data, keyed by the files' sizes and modification times."""
        cache = _range_cache_path(self.prefix)
        try:
            with open(cache) as f:
                low, high = json.load(f)
            return int(low), int(high)
        except (OSError, ValueError, TypeError):
            pass
        tokens = np.frombuffer(self._bin, self.dtype, len(self._bin) // self.dtype.itemsize)
        low, high = 0, -1
        for start in range(0, len(tokens), _RANGE_BLOCK):
            block = tokens[start:start + _RANGE_BLOCK]
            high = max(high, int(block.max()))
            low = min(low, int(block.min())) if self.dtype.kind == "i" else 0
        _write_json_quietly(cache, [low, high])
        return low, high


_RANGE_BLOCK = 1 << 24  # tokens per block of the min/max pass: 32-64 MB


def _range_cache_path(prefix: str) -> str:
    stats = [(os.path.getsize(p), os.stat(p).st_mtime_ns) for p in (prefix + ".bin", prefix + ".idx")]
    digest = hashlib.sha1(json.dumps(stats).encode()).hexdigest()[:16]
    directory = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    return os.path.join(directory, f"{os.path.basename(prefix)}-token-range-{digest}.json")


def _write_json_quietly(path: str, obj) -> None:
    """Write to a temporary name and rename into place (ranks racing here are harmless); a read-only data
    directory only costs the pass again next time."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


class IndexedDatasetWriter:
    """Writes PREFIX.bin while documents arrive and PREFIX.idx at `finalize()`."""

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code; use one of {sorted(map(str, DTYPE_CODES))}")
        self._bin = open(prefix + ".bin", "wb")
        self._lengths: list[int] = []

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(arr.size)

    def add_raw(self, data: bytes, lengths: Iterable[int]) -> None:
        """Append already-encoded documents: `data` is their tokens in this dtype, back to back."""
        self._bin.write(data)
        self._lengths.extend(lengths)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.prefix + ".idx", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, DTYPE_CODES[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))

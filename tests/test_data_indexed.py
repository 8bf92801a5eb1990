"""MMIDIDX files: an independent writer built from the format description must round-trip through
IndexedDataset, and IndexedDatasetWriter must produce the same bytes."""
import struct

import numpy as np
import pytest

from engine.data import IndexedDataset, IndexedDatasetWriter, token_dtype

CODES = {np.uint16: 8, np.int32: 4}


def reference_write(prefix, documents, dtype):
    """Megatron-LM's MMIDIDX v1 layout, written field by field with struct (no engine code).

    `documents` is a list of documents, each a list of sequences (lists of token ids).
    """
    itemsize = np.dtype(dtype).itemsize
    fmt = {np.uint16: "<H", np.int32: "<i"}[dtype]
    lengths, pointers, doc_ends = [], [], [0]
    offset = 0
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                for t in seq:
                    f.write(struct.pack(fmt, t))
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * itemsize
            doc_ends.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_ends)))
        for n in lengths:
            f.write(struct.pack("<i", n))
        for p in pointers:
            f.write(struct.pack("<q", p))
        for d in doc_ends:
            f.write(struct.pack("<q", d))


def sample_docs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    high = 65_000 if dtype is np.uint16 else 2_000_000_000
    docs = [[int(t) for t in rng.integers(0, high, size=int(n))] for n in rng.integers(1, 40, size=12)]
    docs.insert(3, [])  # an empty document
    docs.append([high - 1, 0, 7])
    return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reference_files_read_back_and_engine_writes_identical_bytes(tmp_path, dtype):
    docs = sample_docs(dtype)
    ref, ours = str(tmp_path / "ref"), str(tmp_path / "ours")
    reference_write(ref, [[d] for d in docs], dtype)

    ds = IndexedDataset(ref)
    assert len(ds) == len(docs) and ds.num_documents == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds[3].size == 0

    writer = IndexedDatasetWriter(ours, dtype)
    for d in docs:
        writer.add_document(d)
    writer.finalize()
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(ref + ext, "rb").read(), ext


def test_documents_of_several_sequences_are_read_as_written(tmp_path):
    prefix = str(tmp_path / "multi")
    documents = [[[1, 2, 3], [4]], [[5, 6]], [[], [7, 8, 9, 10], [11]]]
    reference_write(prefix, documents, np.uint16)
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 2, 3, 6]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4], [5, 6], [], [7, 8, 9, 10], [11]]
    assert ds.get(4, 1, 2).tolist() == [8, 9]
    assert ds.get(4, 2).tolist() == [9, 10]
    assert ds.num_tokens == 11


def test_empty_dataset_and_only_empty_documents(tmp_path):
    for name, docs in (("none", []), ("blank", [[], []])):
        prefix = str(tmp_path / name)
        writer = IndexedDatasetWriter(prefix, np.uint16)
        for d in docs:
            writer.add_document(d)
        writer.finalize()
        ref = str(tmp_path / (name + "_ref"))
        reference_write(ref, [[d] for d in docs], np.uint16)
        assert open(prefix + ".idx", "rb").read() == open(ref + ".idx", "rb").read()
        ds = IndexedDataset(prefix)
        assert len(ds) == len(docs) and ds.num_tokens == 0


def test_token_dtype_follows_megatron_threshold():
    assert token_dtype(4096) == np.uint16
    assert token_dtype(65_499) == np.uint16
    assert token_dtype(65_500) == np.int32
    assert token_dtype(128_256) == np.int32


def test_bad_files_are_refused(tmp_path):
    prefix = str(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="preprocess_data"):
        IndexedDataset(prefix)
    open(prefix + ".bin", "wb").close()
    open(prefix + ".idx", "wb").write(b"NOTMMIDX" + bytes(40))
    with pytest.raises(ValueError, match="magic"):
        IndexedDataset(prefix)
    reference_write(prefix, [[[1]]], np.uint16)
    with pytest.raises(IndexError):
        IndexedDataset(prefix)[5]

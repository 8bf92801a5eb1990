"""The data pipeline: tokenizer, Megatron's indexed datasets, packed GPT samples, blends, mock data, the
batch-size schedule and the sampler.

A run resolves its config (engine.resolve.resolve), builds its splits with `build_datasets`, and draws
each iteration's samples from a `BatchSampler` over a `BatchSizeSchedule` (--global-batch-size, or the
--rampup-batch-size ramp): `next(sampler)` gives this data-parallel rank's microbatches of the next
global batch as lists of sample indices, `make_batch` turns one into tensors, and `sampler.state_dict()`
({"consumed_samples": n}) is all a resume needs. One module per piece; the tools (preprocess_data.py,
train_tokenizer.py) drive `preprocess` and `tokenizer` directly.
"""
from engine.data.build import build_datasets
from engine.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, token_dtype
from engine.data.rampup import BatchSizeSchedule
from engine.data.sampler import BatchSampler
from engine.data.tokenizer import Tokenizer

__all__ = ["BatchSampler", "BatchSizeSchedule", "IndexedDataset", "IndexedDatasetWriter", "Tokenizer",
           "build_datasets", "make_batch", "token_dtype"]


def __getattr__(name: str):
    # The tensor helper loads torch (seconds); the tools import this package without needing it.
    if name == "make_batch":
        from engine.data.batch import make_batch
        return make_batch
    raise AttributeError(f"module 'engine.data' has no attribute {name!r}")

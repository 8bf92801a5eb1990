"""Data pipeline: tokenizer, indexed datasets, packed GPT samples, blends, the sampler and batches.

How a trainer uses it:

    from engine.data import build_datasets, BatchSampler, batches
    train, valid, test = build_datasets(cfg, train_samples, valid_samples, test_samples)
    sampler = BatchSampler(consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size)
    for microbatches in batches(train, sampler):   # one list per iteration, this dp rank's share
        for mb in microbatches:                    # {"tokens", "labels", "loss_mask"}: [b, s] tensors
            ...
    checkpoint["data"] = sampler.state_dict()      # {"consumed_samples": n}: all a resume needs

The pieces, one module each:
- `tokenizer.Tokenizer(model_path)`: `.encode(text) -> list[int]`, `.decode(ids) -> str`, `.vocab_size`,
  `.eod`, `.bos`, `.pad`; `tokenizer.train_sentencepiece(lines, model_prefix, vocab_size)` trains one.
- `IndexedDataset(prefix)`: Megatron-LM's MMIDIDX files, memory-mapped: `len()`, `[i]` -> numpy array of
  sequence i, `.get(i, offset, length)`, `.sequence_lengths`, `.document_indices`.
  `IndexedDatasetWriter(prefix, dtype)`: `.add_document(tokens)`, `.finalize()`.
- `gpt_dataset.GPTDataset(indexed, (first_doc, end_doc), seq_length, num_samples, seed)`: `ds[i]` is an
  np.int64 array of seq_length + 1 tokens packed across documents; indices cached beside the data.
- `blend.BlendedDataset` / `blend.blend_indices(phases, size)`: a deterministic weighted interleave whose
  weights may change at given sample positions (`data_phases`).
- `mock.MockGPTDataset(seq_length, vocab_size, num_samples, seed)`: synthetic, learnable samples that
  depend only on (seed, index).
- `build_datasets(cfg, train_samples, valid_samples, test_samples, global_batch_size=None)`:
  (train, valid, test) from cfg.data (data_path, split, mock_data, data_phases), cfg.model.seq_length /
  vocab_size and cfg.training.seed / global_batch_size / rampup_batch_size; a split of 0 samples is None.
- `BatchSampler(consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size,
  total_samples=None)`: iterating yields this rank's microbatches (lists of global sample indices) per
  iteration; `global_batch_size` is an int or a function iteration -> size (`RampupBatchSize`
  implements --rampup-batch-size). `samples_before(iteration, global_batch_size)` converts iterations
  to sample counts.
- `make_batch(dataset, indices, device=None)` / `batches(dataset, sampler, device=None)`: tensors.
- `demo_corpus.build_demo_corpus(out_dir, vocab_size, max_files) -> (tokenizer_model, data_prefix)`.
"""
from engine.data.build import build_datasets
from engine.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, token_dtype
from engine.data.sampler import BatchSampler, RampupBatchSize, samples_before
from engine.data.tokenizer import Tokenizer

__all__ = [
    "BatchSampler", "IndexedDataset", "IndexedDatasetWriter", "RampupBatchSize", "Tokenizer",
    "batches", "build_datasets", "make_batch", "samples_before", "token_dtype",
]


def __getattr__(name: str):
    # The tensor helpers load torch (seconds); the tools import this package without needing it.
    if name in ("batches", "make_batch"):
        from engine.data import batch
        return getattr(batch, name)
    raise AttributeError(f"module 'engine.data' has no attribute {name!r}")

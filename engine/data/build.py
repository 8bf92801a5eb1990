"""From the run's config to its train, valid and test datasets."""
from __future__ import annotations

from engine.config import Config, ConfigError, data_prefixes
from engine.data.blend import BlendedDataset, blend_indices
from engine.data.gpt_dataset import GPTDataset, split_ranges
from engine.data.indexed_dataset import IndexedDataset
from engine.data.mock import MockGPTDataset
from engine.data.rampup import BatchSizeSchedule

SPLITS = ("train", "valid", "test")


def build_datasets(cfg: Config, train_samples: int, valid_samples: int, test_samples: int) -> tuple:
    """(train, valid, test): datasets whose `ds[i]` is an np.int64 array of seq_length + 1 tokens.

    A split asked for 0 samples is None. `cfg` is resolved (engine.config.resolve): its vocabulary size
    sizes mock data, and its batch-size schedule places the `data_phases` switches.
    """
    d, seq_length, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    sizes = (train_samples, valid_samples, test_samples)
    if d.mock_data:
        vocab = cfg.model.vocab_size
        return tuple(MockGPTDataset(seq_length, vocab, n, seed + k) if n else None for k, n in enumerate(sizes))
    if not d.data_path:
        raise ConfigError("--data-path (none): give --data-path PREFIX or use --mock-data")
    sources = data_prefixes(d.data_path)
    indexed = [_open(prefix) for _, prefix in sources]
    weights = [w for w, _ in sources]
    train_phases = _phases(cfg, weights)
    out = []
    for split, n in enumerate(sizes):
        if not n:
            out.append(None)
            continue
        if len(indexed) == 1:
            out.append(_gpt_dataset(cfg, indexed[0], split, n))
            continue
        source, within = blend_indices(train_phases if split == 0 else [(0, weights)], n)
        counts = [int(within[source == k].max(initial=-1)) + 1 for k in range(len(indexed))]
        parts = [_gpt_dataset(cfg, ix, split, c) if c else None for ix, c in zip(indexed, counts)]
        out.append(BlendedDataset(parts, source, within))
    return tuple(out)


def _open(prefix: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--data-path {prefix}: {e}") from None


def _gpt_dataset(cfg: Config, indexed: IndexedDataset, split: int, num_samples: int) -> GPTDataset:
    d = cfg.data
    try:
        first, last = split_ranges(d.split, indexed.num_documents)[split]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if first == last:
        raise ConfigError(f"--split {d.split}: the {SPLITS[split]} split of {indexed.prefix} gets none of its "
                          f"{indexed.num_documents} documents; give that split a larger share")
    try:
        return GPTDataset(indexed, (first, last), cfg.model.seq_length, num_samples, cfg.training.seed)
    except ValueError as e:
        raise ConfigError(f"--data-path {indexed.prefix}: {SPLITS[split]} split: {e}") from None


def _phases(cfg: Config, weights: list) -> list:
    """`data_phases` as [(start_sample, weights)], starting with the --data-path weights at sample 0."""
    phases = cfg.data.data_phases
    if not phases:
        return [(0, weights)]
    batch_sizes = BatchSizeSchedule.from_config(cfg.training)
    out, previous = [(0, weights)], -1
    for phase in phases:
        if not isinstance(phase, dict) or set(phase) != {"start_iter", "weights"}:
            raise ConfigError(f"data_phases: entry {phase!r} must be a mapping with exactly start_iter and weights")
        start, w = phase["start_iter"], phase["weights"]
        if not isinstance(start, int) or start < 0:
            raise ConfigError(f"data_phases: start_iter {start!r} must be a non-negative integer")
        if not isinstance(w, list) or len(w) != len(weights) or not all(isinstance(x, (int, float)) and x >= 0 for x in w) \
                or sum(w) <= 0:
            raise ConfigError(f"data_phases: weights {w!r} must list {len(weights)} non-negative numbers "
                              "(one per --data-path prefix) with a positive sum")
        if start <= previous:
            raise ConfigError(f"data_phases: start_iter {start} must be later than the previous phase's {previous}")
        previous = start
        sample = batch_sizes.samples_before(start)
        if sample == 0:
            out[0] = (0, w)
        else:
            out.append((sample, w))
    return out

"""Ternion's data order equals Megatron-LM's: the same files, seed, sequence length, split and blend give the
same samples in the same order, and the same samples reach the same data-parallel rank and microbatch.

The reference is NVIDIA's megatron-core (a dev extra: `make deps` installs it), whose dataset code runs on
CPU: its BlendedMegatronDatasetBuilder builds GPTDataset / BlendedDataset splits over tiny .bin/.idx files
written here, and Ternion's build_datasets builds its own over the same files. Megatron-LM's pretraining
sampler lives in Megatron-LM's training package, not in megatron-core, so its dealing rule is restated here
from its published behaviour (megatron/training/datasets/data_samplers.py, MegatronPretrainingSampler).
"""
import warnings

import numpy as np
import pytest

from engine.config import Config
from engine.data import BatchSampler, BatchSizeSchedule, IndexedDataset, IndexedDatasetWriter, build_datasets
from engine.data.gpt_dataset import separate_final_epoch, split_ranges

EOD, SEED, SEQ, VOCAB = 2, 1234, 16, 1000
COMPARED = 1000  # samples compared per split


def megatron():
    """megatron-core's dataset classes; a missing install fails here, loudly, rather than skipping."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU machines
            from megatron.core.datasets import blended_megatron_dataset_config as config_module
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    except ImportError as e:
        pytest.fail(f"megatron-core is not importable ({e}); these tests check Ternion's data order against it. "
                    "Install the dev extras: `make deps` (or pip install -e '.[dev]', which pins "
                    "megatron-core==0.16.1)", pytrace=False)
    return config_module, BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


class _Tokenizer:
    """What megatron-core's GPTDatasetConfig reads from a tokenizer (no pad id: Megatron then pads with -1)."""
    vocab_size, eod = VOCAB, EOD
    unique_identifiers = {"class": "test-tokenizer"}


def megatron_splits(blend: list, split: str, sizes: list, seq: int = SEQ, seed: int = SEED) -> list:
    """megatron-core's [train, valid, test] for a --data-path style list ([W1] P1 [W2 P2 ...])."""
    _, builder, gpt_dataset, gpt_config = megatron()
    weighted = len(blend) > 1
    prefixes = blend[1::2] if weighted else blend
    weights = [float(w) for w in blend[0::2]] if weighted else None
    cfg = gpt_config(random_seed=seed, sequence_length=seq, blend=(prefixes, weights), split=split,
                     tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                     eod_mask_loss=False, create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builder(gpt_dataset, sizes, lambda: True, cfg).build()


def ternion_splits(blend: list, split: str, sizes: list, seq: int = SEQ, seed: int = SEED) -> tuple:
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size = seq, VOCAB
    cfg.training.seed, cfg.training.global_batch_size = seed, 8
    cfg.data.data_path, cfg.data.split = blend, split
    return build_datasets(cfg, *sizes, log=lambda line: None)


def write(prefix: str, num_docs: int, seed: int, high: int = 40) -> str:
    """Documents of random lengths ending in EOD, a few of them empty."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(-3, high))
        writer.add_document(np.append(rng.integers(10, VOCAB, size=n), EOD) if n > 0 else [])
    writer.finalize()
    return prefix


def megatron_tokens(ds, i: int) -> np.ndarray:
    """Sample i of a megatron-core GPTDataset or BlendedDataset as seq + 1 tokens (Ternion's form)."""
    item = ds[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])


def assert_same_gpt(mine, theirs, compared: int = COMPARED) -> None:
    """The three indices (values and dtypes) and the first `compared` samples' tokens."""
    assert len(mine) == len(theirs)
    assert np.array_equal(mine.indexed.sequence_lengths, theirs.dataset.sequence_lengths)
    for name in ("document_index", "sample_index", "shuffle_index"):
        a, b = getattr(mine, name), getattr(theirs, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for i in range(min(compared, len(theirs))):
        assert np.array_equal(mine[i], megatron_tokens(theirs, i)), i


def assert_same_blend(mine, theirs) -> None:
    assert len(mine) == len(theirs)
    assert np.array_equal(mine.source, theirs.dataset_index) and np.array_equal(mine.within, theirs.dataset_sample_index)
    parts = [ds for ds in mine.datasets if ds is not None]
    assert len(parts) == len(theirs.datasets)
    for part, reference in zip(parts, theirs.datasets):
        assert sorted(set(part.document_index.tolist())) == reference.indices.tolist()  # the split's sequences
        assert_same_gpt(part, reference, compared=0)
    for i in range(min(COMPARED, len(theirs))):
        assert np.array_equal(mine[i], megatron_tokens(theirs, i)), i


@pytest.mark.parametrize("apart", [True, False], ids=["final-epoch-apart", "final-epoch-shuffled-in"])
def test_single_file_over_several_epochs_equals_megatron(tmp_path, apart):
    prefix = write(str(tmp_path / "corpus"), 300, seed=1)
    split = "98,2,0"
    first, last = split_ranges(split, len(IndexedDataset(prefix)))[0]
    tokens = int(IndexedDataset(prefix).sequence_lengths[first:last].sum())
    full = (3 * tokens - 1) // SEQ  # the samples of three whole epochs
    train = full + (7 if apart else int(0.9 * ((tokens - 1) // SEQ)))  # a fourth epoch used 7 samples deep or 90%
    assert train >= COMPARED and separate_final_epoch(tokens, SEQ, train) == apart
    sizes = [train, 300, 0]
    mine, theirs = ternion_splits([prefix], split, sizes), megatron_splits([prefix], split, sizes)
    assert mine[2] is None and theirs[2] is None
    for m, t in zip(mine[:2], theirs[:2]):
        assert sorted(set(m.document_index.tolist())) == t.indices.tolist()  # the split's sequences
        assert_same_gpt(m, t)


def test_two_source_blend_equals_megatron(tmp_path):
    a, b = write(str(tmp_path / "a"), 400, seed=2), write(str(tmp_path / "b"), 120, seed=3)
    blend, split, sizes = ["0.7", a, "0.3", b], "95,5,0", [1200, 100, 0]  # b's share needs three epochs
    mine, theirs = ternion_splits(blend, split, sizes), megatron_splits(blend, split, sizes)
    for m, t in zip(mine[:2], theirs[:2]):
        assert_same_blend(m, t)


def test_one_weighted_prefix_is_a_one_source_blend_as_in_megatron(tmp_path):
    """`--data-path 1.0 PREFIX` is a blend in Megatron-LM: its source is built 0.5% larger, so its epochs and
    shuffle can differ from `--data-path PREFIX`'s."""
    prefix = write(str(tmp_path / "corpus"), 300, seed=7)
    sizes = [1100, 60, 0]
    mine, theirs = ternion_splits(["1.0", prefix], "98,2,0", sizes), megatron_splits(["1.0", prefix], "98,2,0", sizes)
    for m, t in zip(mine[:2], theirs[:2]):
        assert_same_blend(m, t)


def test_three_source_blend_and_split_at_a_half_tie_equal_megatron(tmp_path):
    """Weights that do not sum to 1, sources of very different sizes, and one of 35 sequences under
    --split 7,2,1, whose valid/test boundary 0.9 x 35 is 31.5 exactly but 31.4999... in Megatron's sums."""
    a, b, c = (write(str(tmp_path / "a"), 500, seed=4), write(str(tmp_path / "b"), 200, seed=5),
               write(str(tmp_path / "c"), 35, seed=6, high=200))
    assert split_ranges("7,2,1", 35) == [(0, 24), (24, 31), (31, 35)]
    blend, split, sizes = ["3", a, "1.5", b, "2", c], "7,2,1", [1500, 300, 0]
    mine, theirs = ternion_splits(blend, split, sizes), megatron_splits(blend, split, sizes)
    for m, t in zip(mine[:2], theirs[:2]):
        assert_same_blend(m, t)


def test_split_boundaries_equal_megatron():
    config_module = megatron()[0]
    for split in ("969,30,1", "7,2,1", "1,1", "1,1,1", "98,2", "90,5,5", "0.6,0.3,0.1", "949,50,1", "2,1,0", "1"):
        matrix = config_module.convert_split_vector_to_split_matrix(config_module.parse_and_normalize_split(split))
        for n in (1, 2, 3, 7, 35, 75, 201, 301, 500, 1000, 1500, 12345):
            # BlendedMegatronDatasetBuilder: int(round(bookend * float(num_elements))); a None split is empty.
            want = [(int(round(m[0] * float(n))), int(round(m[1] * float(n)))) if m else None for m in matrix]
            got = split_ranges(split, n)
            assert [g if w else None for g, w in zip(got, want)] == want, (split, n)
            assert all(g[0] == g[1] for g, w in zip(got, want) if w is None)


def megatron_sampler(consumed: int, total: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """MegatronPretrainingSampler's microbatches for one rank: rounds of mbs x dp samples, this rank's slice."""
    round_ = []
    for index in range(consumed, total):
        round_.append(index)
        if len(round_) == micro_batch_size * dp_size:
            yield round_[dp_rank * micro_batch_size:(dp_rank + 1) * micro_batch_size]
            round_ = []


@pytest.mark.parametrize("schedule", [BatchSizeSchedule.fixed(12), BatchSizeSchedule(4, 4, 96, 16)],
                         ids=["fixed-3-microbatches", "rampup-1-to-4-microbatches"])
def test_sampler_deals_ranks_and_microbatches_as_megatron(schedule):
    """dp 2, micro batch 2: each iteration Megatron-LM's train step pulls gbs / (mbs x dp) microbatches from
    its loader; Ternion's BatchSampler gives each rank the same ones, from the start and after a resume."""
    mbs, dp, iterations = 2, 2, 20
    total = schedule.samples_before(iterations)
    for resume_at in (0, 7):
        consumed = schedule.samples_before(resume_at)
        for rank in range(dp):
            reference = megatron_sampler(consumed, total, mbs, rank, dp)
            sampler = BatchSampler(schedule, mbs, rank, dp, consumed_samples=consumed)
            for _ in range(resume_at, iterations):
                want = [next(reference) for _ in range(sampler.batch_size // (mbs * dp))]
                assert next(sampler) == want
            assert sampler.state_dict() == {"consumed_samples": total}
    # Several microbatches per rank, interleaved with the other rank's: not contiguous slices.
    assert next(BatchSampler(BatchSizeSchedule.fixed(12), mbs, 1, dp)) == [[2, 3], [6, 7], [10, 11]]

"""Packed GPT samples, blends and phases, mock data, the resumable sampler and batch tensors."""
import os

import numpy as np
import pytest
import torch

from engine.config import Config, ConfigError
from engine.data import (
    BatchSampler,
    BatchSizeSchedule,
    IndexedDataset,
    IndexedDatasetWriter,
    build_datasets,
    gpt_dataset,
    make_batch,
)
from engine.data.blend import blend_indices
from engine.data.gpt_dataset import GPTDataset, split_ranges
from engine.data.mock import MockGPTDataset

EOD = 2


def write_dataset(prefix, num_docs, seed, low=0, high=60):
    """Documents of random lengths (some empty) ending in EOD; returns them."""
    rng = np.random.default_rng(seed)
    docs = []
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(low, high))
        doc = np.append(rng.integers(10, 1000, size=n), EOD) if n else np.zeros(0, np.int64)
        docs.append(doc)
        writer.add_document(doc)
    writer.finalize()
    return docs


@pytest.fixture
def data(tmp_path):
    prefix = str(tmp_path / "corpus")
    return prefix, write_dataset(prefix, 200, seed=0)


def stream_of(ds):
    docs = [ds.indexed[int(d)] for d in ds.document_index]
    return np.concatenate(docs).astype(np.int64)


def test_samples_are_packed_slices_of_the_shuffled_stream_over_several_epochs(data):
    """Megatron-LM's order: full epochs are shuffled together; a last epoch used under 80% is kept apart
    (its documents after all the others', its samples served after theirs), one used more joins the rest."""
    prefix, docs = data
    ix = IndexedDataset(prefix)
    tokens = sum(len(d) for d in docs)
    seq = 32
    full = ((3 * tokens) - 1) // seq  # samples of the first three epochs
    per_epoch = (tokens - 1) // seq
    for num_samples, apart in ((full + 5, True), (full + int(0.9 * per_epoch), False)):
        ds = GPTDataset(ix, (0, len(docs)), seq, num_samples, seed=5)
        assert len(ds) >= num_samples
        assert len(ds.document_index) == 4 * len(docs)  # 3 epochs and a bit
        first, last = ds.document_index[:3 * len(docs)].tolist(), ds.document_index[3 * len(docs):].tolist()
        assert sorted(first + last) == sorted(list(range(len(docs))) * 4)
        assert (sorted(last) == list(range(len(docs)))) == apart
        assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
        stream = stream_of(ds)
        for i in range(len(ds)):
            j = int(ds.shuffle_index[i])
            sample = ds[i]
            assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
            assert np.array_equal(sample, stream[j * seq:j * seq + seq + 1])
        # Kept apart: the final epoch's samples come after all the full ones.
        assert (set(ds.shuffle_index[:full].tolist()) == set(range(full))) == apart


def test_indices_are_deterministic_cached_and_keyed_by_parameters(data, monkeypatch):
    prefix, docs = data
    ix = IndexedDataset(prefix)
    a = GPTDataset(ix, (0, 150), 16, 100, seed=1)
    cached = sorted(os.listdir(os.path.join(os.path.dirname(prefix), "cache")))
    assert len(cached) == 3
    calls = []
    real = gpt_dataset.build_indices
    monkeypatch.setattr(gpt_dataset, "build_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    b = GPTDataset(ix, (0, 150), 16, 100, seed=1)
    assert calls == []  # loaded from the cache
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    c = GPTDataset(ix, (0, 150), 16, 100, seed=2)
    assert calls == [1]
    assert not all(np.array_equal(a[i], c[i]) for i in range(len(a)))
    # Only the train documents are used.
    assert set(a.document_index.tolist()) <= set(range(150))


def test_split_ranges():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("8,1,1", 50) == [(0, 40), (40, 45), (45, 50)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            split_ranges(bad, 10)


def window_shares(source, k, window=1000):
    onehot = np.eye(k)[source]
    counts = np.concatenate([np.zeros((1, k)), np.cumsum(onehot, axis=0)])
    return (counts[window:] - counts[:-window]) / window


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.05, 0.95], [1, 2, 3, 4]])
def test_blend_shares_within_one_percent_on_every_window(weights):
    source, within = blend_indices([(0, weights)], 20_000)
    w = np.asarray(weights, float) / sum(weights)
    assert np.abs(window_shares(source, len(w)) - w).max() <= 0.01
    for k in range(len(w)):  # each source serves its samples in order, none twice
        assert within[source == k].tolist() == list(range(int((source == k).sum())))


def test_blend_phases_switch_at_their_sample_and_continue_each_source():
    source, within = blend_indices([(0, [1, 0]), (3000, [0.5, 0.5]), (7000, [0, 1])], 10_000)
    assert (source[:3000] == 0).all()
    assert np.abs(window_shares(source[3000:7000], 2) - 0.5).max() <= 0.01
    assert (source[7000:] == 1).all()
    for k in range(2):
        assert within[source == k].tolist() == list(range(int((source == k).sum())))


def make_cfg(**data):
    cfg = Config()
    cfg.model.seq_length = 16
    cfg.training.seed, cfg.training.global_batch_size = 3, 8  # as engine.resolve.resolve leaves it
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_build_datasets_blend_with_phase_switches_at_configured_iteration(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, 300, seed=1)
    write_dataset(b, 300, seed=2)
    cfg = make_cfg(data_path=["0.7", a, "0.3", b], split="90,5,5",
                   data_phases=[{"start_iter": 50, "weights": [0.0, 1.0]}])
    cfg.training.global_batch_size = 8
    train, valid, test = build_datasets(cfg, 800, 40, 0)
    assert test is None and len(train) == 800 and len(valid) == 40
    switch = 50 * 8
    assert np.abs(window_shares(train.source[:switch], 2, window=400) - [0.7, 0.3]).max() <= 0.01
    assert (train.source[switch:] == 1).all()
    for i in (0, 1, 2, switch - 1, switch, 799):
        src = train.datasets[int(train.source[i])]
        assert np.array_equal(train[i], src[int(train.within[i])])
        assert train[i].shape == (17,)
    # Valid draws from the valid documents of both sources, with the --data-path weights.
    assert set(valid.source.tolist()) == {0, 1}
    assert set(valid.datasets[0].document_index.tolist()) <= set(range(270, 285))

    cfg.training.rampup_batch_size = [4, 4, 64]
    train_ramp, _, _ = build_datasets(cfg, 800, 0, 0)
    switch = BatchSizeSchedule(4, 4, 64, 8).samples_before(50)
    assert switch < 400 and (train_ramp.source[switch:] == 1).all()
    assert abs((train_ramp.source[:switch] == 0).mean() - 0.7) < 0.01


def test_build_datasets_reports_user_mistakes(tmp_path):
    a = str(tmp_path / "a")
    write_dataset(a, 20, seed=1)
    cases = [
        (make_cfg(data_path=[str(tmp_path / "missing")]), "--data-path"),
        (make_cfg(data_path=[a], split="100,0,0"), "valid split"),
        (make_cfg(data_path=["1", a, "1", a], data_phases=[{"start_iter": 5, "weights": [1]}]), "data_phases"),
        (make_cfg(data_path=["1", a, "1", a], data_phases=[{"start": 5}]), "data_phases"),
    ]
    for cfg, match in cases:
        with pytest.raises(ConfigError, match=match):
            build_datasets(cfg, 10, 10, 0)


def test_mock_data_depends_only_on_seed_and_index_and_is_learnable():
    cfg = make_cfg(mock_data=True)
    cfg.model.vocab_size = 100
    train, valid, test = build_datasets(cfg, 1000, 10, 0)
    again = MockGPTDataset(16, 100, 5000, seed=3)  # a different length changes nothing
    assert all(np.array_equal(train[i], again[i]) for i in (0, 7, 999))
    other_seed = MockGPTDataset(16, 100, 1000, seed=4)
    assert not np.array_equal(train[7], other_seed[7])
    assert test is None and not np.array_equal(train[0], valid[0])
    samples = np.stack([train[i] for i in range(200)])
    assert samples.dtype == np.int64 and samples.min() >= 0 and samples.max() < 100
    # Most next tokens follow from the previous two (the pattern); a few are noise.
    step = (samples[:, 1:-1] - samples[:, :-2]) % 100
    predicted = (samples[:, 1:-1] + step) % 100
    hit = (predicted == samples[:, 2:]).mean()
    assert 0.6 < hit < 0.95


def test_sampler_resume_is_exact_and_dp_slices_partition_each_batch():
    gbs, mbs, dp = 12, 2, 3
    fixed = BatchSizeSchedule.fixed(gbs)
    uninterrupted = BatchSampler(fixed, mbs, 1, dp)
    first = [next(uninterrupted) for _ in range(10)]
    resumed = BatchSampler(fixed, mbs, 1, dp)
    resumed.load_state_dict({"consumed_samples": 5 * gbs})
    assert [next(resumed) for _ in range(5)] == first[5:]
    assert resumed.state_dict() == {"consumed_samples": 10 * gbs}
    for consumed in (0, 36):
        ranks = [next(BatchSampler(fixed, mbs, r, dp, consumed_samples=consumed)) for r in range(dp)]
        flat = [i for rank in ranks for mb in rank for i in mb]
        assert sorted(flat) == list(range(consumed, consumed + gbs))  # disjoint and covering
        assert all(len(mb) == mbs for rank in ranks for mb in rank) and all(len(r) == 2 for r in ranks)


def test_sampler_with_batch_size_rampup_resumes_between_any_two_iterations():
    ramp = BatchSizeSchedule(4, 4, 48, 16)
    sizes = [ramp.samples_before(i + 1) - ramp.samples_before(i) for i in range(12)]
    assert sizes[0] == 4 and sizes[-1] == 16 and sizes == sorted(sizes)
    dp = 2
    full = {r: [next(s) for _ in range(12)] for r, s in ((r, BatchSampler(ramp, 2, r, dp)) for r in range(dp))}
    for it in range(12):
        consumed = ramp.samples_before(it)
        assert ramp.at(consumed) == sizes[it]
        batch = sorted(i for r in range(dp) for mb in full[r][it] for i in mb)
        assert batch == list(range(consumed, consumed + sizes[it]))
        for r in range(dp):
            assert next(BatchSampler(ramp, 2, r, dp, consumed_samples=consumed)) == full[r][it]
    with pytest.raises(ValueError, match="not a multiple"):
        next(BatchSampler(BatchSizeSchedule.fixed(6), 2, 0, dp))


def test_make_batch_shifts_labels_by_one():
    ds = MockGPTDataset(8, 50, 10, seed=0)
    batch = make_batch(ds, [3, 4])
    assert batch["tokens"].shape == (2, 8) and batch["tokens"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    assert torch.equal(batch["labels"][0], torch.from_numpy(ds[3][1:]))
    assert torch.equal(batch["tokens"][1], torch.from_numpy(ds[4][:-1]))


def write_docs(prefix, docs, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()


def test_an_empty_dataset_is_named_alone_and_in_a_blend(tmp_path):
    empty, a = str(tmp_path / "empty"), str(tmp_path / "a")
    write_docs(empty, [])
    write_dataset(a, 20, seed=1)
    for data_path in ([empty], ["1", a, "1", empty]):
        with pytest.raises(ConfigError) as info:
            build_datasets(make_cfg(data_path=data_path), 10, 10, 0)
        assert str(info.value).startswith(f"--data-path {empty}: {empty}.bin holds no tokens (0 documents)")
        assert "--split" not in str(info.value)


def test_token_ids_past_the_vocabulary_name_file_id_vocab_and_flag(tmp_path):
    prefix = str(tmp_path / "c")
    write_dataset(prefix, 50, seed=0)  # ids 2 and 10..999
    cfg = make_cfg(data_path=[prefix])
    cfg.model.vocab_size = 256
    with pytest.raises(ConfigError) as info:
        build_datasets(cfg, 10, 0, 0)
    high = int(IndexedDataset(prefix).token_range()[1])
    assert high == max(int(IndexedDataset(prefix)[i].max(initial=0)) for i in range(50)) and high >= 256
    assert str(info.value) == (f"--data-path {prefix}: {prefix}.bin holds token id {high} but the vocabulary has 256 "
                               "ids (--vocab-size 256); give the tokenizer the data was made with (--tokenizer-model "
                               f"FILE.model) or a --vocab-size above {high}")
    cfg.model.vocab_size = high + 1
    assert build_datasets(cfg, 10, 0, 0, log=lambda line: None)[0] is not None
    # The range is computed once and kept beside the data; rewriting the data computes it again.
    cached = [f for f in os.listdir(tmp_path / "cache") if "-token-range-" in f]
    assert len(cached) == 1
    write_docs(prefix, [np.array([5, 4000, 2])])
    assert IndexedDataset(prefix).token_range() == (0, 4000)
    write_docs(prefix, [np.array([5, -7, 2])], np.int32)
    with pytest.raises(ConfigError, match="negative token id -7"):
        build_datasets(cfg, 10, 0, 0)


def test_token_range_of_a_few_megabytes_is_cheap(tmp_path):
    import time
    prefix = str(tmp_path / "big")
    tokens = np.random.default_rng(0).integers(0, 32000, size=4_000_000).astype(np.uint16)  # 8 MB
    write_docs(prefix, np.split(tokens, 1000))
    start = time.perf_counter()
    assert IndexedDataset(prefix).token_range() == (0, int(tokens.max()))
    assert time.perf_counter() - start < 1.0


def test_summary_per_source_and_a_warning_when_the_run_repeats_a_tiny_split(tmp_path):
    tiny, big = str(tmp_path / "tiny"), str(tmp_path / "big")
    write_docs(tiny, [np.arange(10, 20)])  # one document of 10 tokens
    write_dataset(big, 300, seed=2)
    cfg = make_cfg(data_path=[tiny], split="1,0,0")
    cfg.model.seq_length = 64
    lines = []
    build_datasets(cfg, 16, 0, 0, log=lines.append)
    assert lines[0] == f"data: {tiny}: 1 document, 10 tokens; train 1 document, 10 tokens: 16 samples need 102 epochs"
    assert len(lines) == 2 and lines[1] == (
        f"warning: data: the run reads the train split of {tiny} (1 document, 10 tokens) 102 times over (16 samples "
        "of 64 tokens); past 4 epochs repeated data adds little (Muennighoff et al. 2023): add data, lower "
        "--train-iters or give train a larger --split share")
    lines.clear()
    write_docs(tiny, [np.arange(10, 20)] * 10)  # now 10 such documents
    cfg = make_cfg(data_path=["0.5", big, "0.5", tiny], split="90,10,0")
    build_datasets(cfg, 100, 20, 0, log=lines.append)
    assert [line.split(":")[1].strip() for line in lines[:2]] == [f"{big} (weight 0.5)", f"{tiny} (weight 0.5)"]
    assert "train 270 documents" in lines[0] and "valid 30 documents" in lines[0] and len(lines) == 3
    assert "warning" in lines[2] and tiny in lines[2]  # the blend's tiny source, not the big one
    ok = make_cfg(data_path=[big], split="90,10,0")
    lines.clear()
    build_datasets(ok, 100, 20, 0, log=lines.append)
    assert len(lines) == 1 and "epochs" in lines[0] and "warning" not in lines[0]


def test_bad_phase_weights_are_refused(tmp_path):
    a = str(tmp_path / "a")
    write_dataset(a, 30, seed=1)
    for weights in ([float("nan"), 1.0], [float("inf"), 1.0], [0, 0]):
        cfg = make_cfg(data_path=["1", a, "1", a], data_phases=[{"start_iter": 5, "weights": weights}])
        with pytest.raises(ConfigError, match="data_phases: weights .* with a positive sum"):
            build_datasets(cfg, 100, 0, 0)


@pytest.mark.parametrize("from_last_epoch,separate", [(1, True), (79, True), (80, False), (81, False), (100, False)])
def test_the_last_epoch_is_shuffled_apart_below_megatrons_80_percent_and_not_at_it(from_last_epoch, separate):
    """1001 tokens an epoch of 10-token samples (plus the extra label token): 100 samples an epoch, so the second
    epoch is shuffled on its own when fewer than int(0.8 * 100) = 80 of its samples are used (megatron-core's
    GPTDataset: `num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)`)."""
    num_samples = 100 + from_last_epoch
    assert gpt_dataset.num_epochs(1001, 10, num_samples) == 2
    assert gpt_dataset.separate_final_epoch(1001, 10, num_samples) is separate
    lengths = np.full(7, 143, dtype=np.int32)  # 7 documents of 143 tokens: the same 1001 tokens an epoch
    docs, _, _ = gpt_dataset.build_indices(lengths, np.arange(7), 10, num_samples, seed=3)
    tail_is_one_epoch = sorted(docs[-7:].tolist()) == list(range(7)) and sorted(docs[:7].tolist()) == list(range(7))
    if separate:  # the epochs are shuffled apart: each half holds every document once
        assert tail_is_one_epoch
    assert len(docs) == 14

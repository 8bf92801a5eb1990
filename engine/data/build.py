"""From the run's config to its train, valid and test datasets, and a summary of what each source gives.

Each --data-path dataset is checked when it is opened (it holds tokens, and every token id is inside the
model's vocabulary); once the splits are sized, one line per source says how many documents and tokens
each split holds and how many epochs over them the run needs, printed once (rank 0).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from typing import Callable, Optional

import numpy as np

from engine.config import Config, ConfigError, _err
from engine.data.blend import BlendedDataset, blend_indices, blend_sizes
from engine.data.gpt_dataset import GPTDataset, cached_arrays, split_ranges
from engine.data.indexed_dataset import IndexedDataset
from engine.data.mock import MockGPTDataset
from engine.data.rampup import BatchSizeSchedule
from engine.data.tokenizer_spec import tokenizer_of, vocab_source

SPLITS = ("train", "valid", "test")
# A train split read more often than this gets a warning. Repeating data for up to about 4 epochs costs
# little against fresh data; beyond that each repeat is worth less and less (Muennighoff et al. 2023,
# "Scaling Data-Constrained Language Models"). Validation may cycle its small split without harm.
EPOCH_WARNING = 4.0


def build_datasets(cfg: Config, train_samples: int, valid_samples: int, test_samples: int,
                   log: Optional[Callable[[str], None]] = None) -> tuple:
    """(train, valid, test): datasets whose `ds[i]` is an np.int64 array of seq_length + 1 tokens.

    A split asked for 0 samples is None. `cfg` is resolved (engine.resolve.resolve): its vocabulary size
    sizes mock data and bounds the token ids, and its batch-size schedule places the `data_phases`
    switches. The data summary goes to `log` (default: print on rank 0).
    """
    log = log or _print_on_rank0
    d, seq_length, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    sizes = (train_samples, valid_samples, test_samples)
    if d.mock_data:
        vocab = cfg.model.vocab_size
        log(f"data: synthetic tokens (--mock-data), vocabulary {vocab}, seed {seed}")
        return tuple(MockGPTDataset(seq_length, vocab, n, seed + k) if n else None for k, n in enumerate(sizes))
    if not d.data_path:
        raise ConfigError("--data-path (none): give --data-path PREFIX or use --mock-data")
    sources = data_prefixes(d.data_path)
    indexed = check_data(d.data_path, cfg.model.vocab_size, vocab_source(cfg))
    weights = [w for w, _ in sources]
    train_phases = _phases(cfg, weights)
    out, drawn = [], np.zeros((len(indexed), len(SPLITS)), dtype=np.int64)  # samples per source and split
    for split, n in enumerate(sizes):
        if not n:
            out.append(None)
            continue
        if len(d.data_path) == 1:  # one prefix and no weight: Megatron-LM builds its dataset alone
            drawn[0, split] = n
            out.append(_gpt_dataset(cfg, indexed[0], split, n))
            continue
        # A weighted --data-path, even of one prefix, is a blend in Megatron-LM: its length and each source's
        # dataset size are Megatron's (blend_sizes). With data_phases (Ternion's) it is n samples long and
        # each source is sized for what the phases take from it.
        phases = train_phases if split == 0 else [(0, weights)]
        size, counts = blend_sizes(phases[0][1], n) if len(phases) == 1 else (n, None)
        source, within = _blend_indices(phases, size, indexed[0].prefix)
        if counts is None:
            counts = [int(within[source == k].max(initial=-1)) + 1 for k in range(len(indexed))]
        drawn[:, split] = np.bincount(source[:n], minlength=len(indexed))
        parts = [_gpt_dataset(cfg, ix, split, c) if c else None for ix, c in zip(indexed, counts)]
        out.append(BlendedDataset(parts, source, within))
    _summarise(cfg, sources, indexed, drawn, log)
    if d.eod_mask_loss:  # make_batch reads it: no loss on the token after an end-of-document token
        eod = end_of_document(cfg)
        for ds in out:
            if ds is not None:
                ds.eod_mask = eod
    return tuple(out)


DOCUMENT_FLAGS = (("eod_mask_loss", "--eod-mask-loss"), ("reset_attention_mask", "--reset-attention-mask"),
                  ("reset_position_ids", "--reset-position-ids"))
ENDS_CHECKED = 100  # documents whose last token --reset-attention-mask / --reset-position-ids look at


def document_flags(data) -> list:
    """The flags given that read document boundaries off the end-of-document token."""
    return [flag for name, flag in DOCUMENT_FLAGS if getattr(data, name)]


def end_of_document(cfg: Config) -> int:
    """The id that ends each document in the run's data (its tokenizer's), for the flags that read document
    boundaries (--eod-mask-loss, --reset-attention-mask, --reset-position-ids)."""
    spec = tokenizer_of(cfg)
    eod = spec.build().eod if spec is not None else None
    if eod is None:
        flag = (document_flags(cfg.data) or ["--eod-mask-loss"])[0]
        raise ConfigError(f"{flag}: the run names no tokenizer with an end-of-document token; give the "
                          f"--tokenizer-model (or --tokenizer-type) the data was made with, or drop {flag}")
    return eod


def check_document_ends(data_path: list, eod: int, flag: str) -> None:
    """Packed samples can be cut into documents only where documents end with `eod` (tools/preprocess_data.py
    --append-eod): one of the first ENDS_CHECKED non-empty documents of each --data-path prefix must."""
    for _, prefix in data_prefixes(data_path):
        indexed = IndexedDataset(prefix)
        ends = [int(indexed.get(i, n - 1, 1)[0]) for i, n in enumerate(indexed.sequence_lengths[:ENDS_CHECKED]) if n]
        if ends and eod not in ends:
            raise ConfigError(f"{flag}: no document of {prefix} ends with the end-of-document token {eod} (the first "
                              f"{len(ends)} looked at), so its packed samples cannot be cut into documents; make "
                              "the data with tools/preprocess_data.py --append-eod, or drop the flag")


def data_prefixes(data_path: list) -> list:
    """`[W1] P1 [W2 P2 ...]` -> [(weight, prefix)]; a single prefix gets weight 1."""
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) % 2:
        _err("--data-path", " ".join(data_path), "give either one prefix or pairs of WEIGHT PREFIX")
    pairs = []
    for w, p in zip(data_path[0::2], data_path[1::2]):
        try:
            weight = float(w)
        except ValueError:
            _err("--data-path", w, "expected a weight (a number) before each prefix")
        if not math.isfinite(weight) or weight < 0:
            _err("--data-path", w, "each blend weight must be a finite non-negative number (e.g. 0.7)")
        pairs.append((weight, p))
    if sum(weight for weight, _ in pairs) <= 0:
        _err("--data-path", " ".join(data_path), "the blend weights sum to 0; give at least one source a positive "
                                                 "weight")
    return pairs


def check_data(data_path: list, vocab_size: Optional[int], vocab_from: str = "") -> list:
    """Open every dataset of `data_path` ([W1] PREFIX1 ...): each must hold tokens, all of them ids below
    `vocab_size` (not checked when None; `vocab_from` says which flag set it). Raises ConfigError."""
    return [_open(prefix, vocab_size, vocab_from) for _, prefix in data_prefixes(data_path)]


def _open(prefix: str, vocab_size: Optional[int], vocab_from: str) -> IndexedDataset:
    try:
        indexed = IndexedDataset(prefix)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--data-path {prefix}: {e}") from None
    if indexed.num_tokens == 0:
        raise ConfigError(f"--data-path {prefix}: {prefix}.bin holds no tokens ({indexed.num_documents} documents); "
                          "make it again with tools/preprocess_data.py (check --input and --json-keys) or leave it out")
    if vocab_size:
        low, high = indexed.token_range()
        if low < 0:
            raise ConfigError(f"--data-path {prefix}: {prefix}.bin holds the negative token id {low}; it is damaged "
                              "or not token ids: make it again with tools/preprocess_data.py")
        if high >= vocab_size:
            raise ConfigError(f"--data-path {prefix}: {prefix}.bin holds token id {high} but the vocabulary has "
                              f"{vocab_size} ids ({vocab_from}); give the tokenizer the data was made with "
                              f"(--tokenizer-model FILE.model) or a --vocab-size above {high}")
    return indexed


def _summarise(cfg: Config, sources: list, indexed: list, drawn: np.ndarray, log) -> None:
    """One line per source: its documents and tokens, and for each split used what the run draws from it."""
    seq, warnings = cfg.model.seq_length, []
    for (weight, prefix), ix, samples in zip(sources, indexed, drawn):
        parts = []
        for split, (first, last) in enumerate(split_ranges(cfg.data.split, len(ix))):
            if not samples[split]:
                continue
            tokens = int(ix.sequence_lengths[first:last].sum(dtype=np.int64))
            epochs = (int(samples[split]) * seq + 1) / max(tokens, 1)
            size = f"{_count(last - first, 'document')}, {_count(tokens, 'token')}"
            parts.append(f"{SPLITS[split]} {size}: {samples[split]:,} samples need {_epochs(epochs)} epochs")
            if split == 0 and epochs > EPOCH_WARNING:
                warnings.append(f"warning: data: the run reads the train split of {prefix} ({size}) {_epochs(epochs)} "
                                f"times over ({samples[split]:,} samples of {seq} tokens); past {EPOCH_WARNING:g} "
                                "epochs repeated data adds little (Muennighoff et al. 2023): add data, lower "
                                "--train-iters or give train a larger --split share")
        weight_note = f" (weight {weight:g})" if len(sources) > 1 else ""
        log(f"data: {prefix}{weight_note}: {_count(ix.num_documents, 'document')}, {_count(ix.num_tokens, 'token')}; "
            + "; ".join(parts))
    for line in warnings:
        log(line)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _epochs(epochs: float) -> str:
    return f"{epochs:.2f}" if epochs < 10 else f"{math.floor(epochs):,}"


def _print_on_rank0(line: str) -> None:
    """Print on global rank 0 only: the process group's rank once one exists, else $RANK (torchrun's)."""
    dist = sys.modules.get("torch.distributed")  # never imported here: the tools use this module without torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        print(line, flush=True)


def _gpt_dataset(cfg: Config, indexed: IndexedDataset, split: int, num_samples: int) -> GPTDataset:
    d = cfg.data
    try:
        first, last = split_ranges(d.split, len(indexed))[split]  # over sequences, as Megatron-LM splits
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if first == last:
        raise ConfigError(f"--split {d.split}: the {SPLITS[split]} split of {indexed.prefix} gets none of its "
                          f"{len(indexed)} documents; give that split a larger share")
    try:
        return GPTDataset(indexed, (first, last), cfg.model.seq_length, num_samples, cfg.training.seed)
    except ValueError as e:
        raise ConfigError(f"--data-path {indexed.prefix}: {SPLITS[split]} split: {e}") from None


def _blend_indices(phases: list, size: int, prefix: str) -> tuple:
    """blend_indices, kept in the first source's cache/ (they depend only on the phases and the size: a
    Python loop of about 0.3 s per million samples, paid once)."""
    key = json.dumps({"version": 1, "phases": [[int(s), [float(x) for x in w]] for s, w in phases], "size": size})
    stem = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache",
                        f"blend-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
    return cached_arrays(stem, ("source", "within"), lambda: blend_indices(phases, size))


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
        if not isinstance(w, list) or len(w) != len(weights) or not _weights_ok(w) or sum(w) <= 0:
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


def _weights_ok(weights: list) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in weights)

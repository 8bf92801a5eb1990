"""Load the newest complete checkpoint into model chunks and optimizer of any layout.

Rank 0 picks the iteration and every rank confirms it sees the same one. Each rank checks the files
it will read (size and sha256 against metadata.json); the checkpoint must hold exactly the model's
tensors (over all ranks) at their full shapes, so a checkpoint of another model is refused with one
line naming the tensor, both shapes and the flags that differ. The ranks then agree, so all of them
load the same iteration or all of them stop with the same one-line error. With `fallback`, older iterations are tried
newest first. Tensors are read slice by slice (see reader.py), so a changed tp, pp, vpp, dp or
distributed-optimizer setting reshards at load. RNG streams are restored only when the layout is
the one saved, since a stream belongs to a rank's position in that layout.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Mapping
from typing import Optional

import torch

from engine import fp8
from engine.checkpoint import files, rng
from engine.checkpoint.layout import local_tensors
from engine.checkpoint.metadata import OPTIMIZER_KEYS
from engine.checkpoint.reader import CheckpointReader
from engine.config import ConfigError
from engine.config.model_changes import model_differences, shown
from engine.model import GPTModel
from engine.parallel.comm import all_gather_object
from engine.parallel.layers import spec_of
from engine.parallel.topology import ParallelContext


def latest_iteration(save_dir: str) -> Optional[int]:
    """The iteration `latest_checkpointed_iteration.txt` names, or None (see Checkpointer.latest for a
    run with a save in flight)."""
    return files.read_latest(save_dir)


def load_checkpoint(load_dir: str, model_chunks: list, optimizer, ctx, fallback: bool = False,
                    load_optim: bool = True, iteration: Optional[int] = None, model_cfg=None) -> Optional[dict]:
    """Load into `model_chunks` (and `optimizer`); return the saved extra_state plus `iteration`, the saved
    `config` and, when it was saved under another layout, `saved_layout` (its degrees, for the resume line), or
    None when `load_dir` holds no checkpoint. Raises ConfigError (one line) on damage or a
    checkpoint of a different model.

    The iteration loaded is `iteration`, else the one `latest_checkpointed_iteration.txt` names (the newest
    iteration folder if that file is gone); with `fallback`, older complete ones are tried when it is
    damaged. Rank 0 resolves the candidates and every rank checks that it sees the same checkpoint
    (a collective): ranks never load different iterations. With `model_cfg` (the run's resolved
    ModelConfig) the checkpoint must hold no tensor the model lacks, and a mismatch names the flags.
    """
    if not os.path.isdir(load_dir):
        raise ConfigError(f"--load {load_dir}: directory not found; check the path or drop --load")
    candidates = _agreed_candidates(load_dir, fallback, iteration, ctx)
    if not candidates:
        return None
    tensors = local_tensors(model_chunks, ctx)
    model_names = _model_names(model_cfg) if model_cfg is not None else None
    ranges = {}  # local name -> the flat range of it this rank's optimizer updates
    if optimizer is not None and load_optim:
        ranges = {name: tuple(e["range"]) for name, e in optimizer.state_dict()["params"].items()}
    for n, it in enumerate(candidates):
        path = os.path.join(load_dir, files.iter_dir_name(it))
        reader, problem = _open_and_check(path, tensors, ranges, ctx, model_names, model_cfg,
                                          getattr(optimizer, "name", "adam"))
        problems = [p for p in all_gather_object(problem) if p]
        if not problems:
            _same_everywhere(reader, path)
            fp8.load_state_dict(model_chunks, reader.meta.extra_state.get("fp8", {}))
            return _load(reader, tensors, optimizer, ranges, ctx)
        model_mismatch = problems[0].startswith(MISMATCH)
        if n + 1 == len(candidates) or model_mismatch:
            older = len(files.list_iterations(load_dir)) > 1
            hint = "; use --ckpt-fallback to load the newest complete checkpoint instead" \
                if older and not fallback and not model_mismatch else ""
            raise ConfigError(problems[0] + hint)
        if ctx.rank == 0:
            print(f"checkpoint: {problems[0]}; falling back to iteration {candidates[n + 1]}", file=sys.stderr)
    return None


MISMATCH = "the checkpoint is of a different model:"


def _candidates(load_dir: str, fallback: bool) -> list:
    latest = files.read_latest(load_dir)
    done = files.list_iterations(load_dir)[::-1]
    if latest is None:
        return done if fallback else done[:1]
    return [latest] + [i for i in done if i != latest] if fallback else [latest]


def _agreed_candidates(load_dir: str, fallback: bool, iteration: Optional[int], ctx) -> list:
    """Rank 0's candidates, after every rank confirmed it sees the same first one (else ConfigError everywhere)."""
    mine = [iteration] if iteration is not None else _candidates(load_dir, fallback)
    seen = all_gather_object(mine[0] if mine else None)
    odd = [r for r, it in enumerate(seen) if it != seen[0]]
    if odd:
        raise ConfigError(f"--load {load_dir}: ranks see different checkpoints (rank 0: iteration {seen[0]}, rank "
                          f"{odd[0]}: iteration {seen[odd[0]]}); another job may be writing there, or the file "
                          f"system is not shared alike by all nodes; stop the other writer and restart")
    return all_gather_object(mine)[0]


def _same_everywhere(reader, path: str) -> None:
    """Every rank opened the same metadata (same bytes): a second writer replacing it mid-load is an error."""
    with open(os.path.join(path, files.METADATA_FILE), "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    digests = all_gather_object(digest)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise ConfigError(f"checkpoint {path} changed while loading (rank {odd[0]} read different metadata than "
                          "rank 0); another job is writing into this directory; stop it and restart")


def _mismatch(path: str, what: str, model_cfg, saved_cfg: dict) -> str:
    """One line naming the flags (checkpoint's value, this run's) that make the model differ; the tensor only when
    the checkpoint records no model setting that explains it."""
    flags = model_differences(saved_cfg.get("model") or {}, model_cfg) if model_cfg is not None else []
    if flags:
        return (f"{MISMATCH} {path} was saved with {' '.join(f'{f} {shown(old)}' for f, old, _ in flags)} (this run: "
                f"{', '.join(f'{f} {shown(new)}' for f, _, new in flags)}); train with the checkpoint's values")
    return f"{MISMATCH} {path}: {what}; use the model flags it was saved with"


def _model_names(model_cfg) -> set:
    """The global names of every tensor the model of `model_cfg` has, whatever the layout (a meta-device build)."""
    model = GPTModel(model_cfg, ParallelContext.virtual(), device="meta")
    return {spec_of(p).copy_of or name for name, p in model.named_parameters()}


def _open_and_check(path: str, tensors: list, ranges: dict, ctx, model_names, model_cfg=None,
                    optimizer_name: str = "adam") -> tuple:
    """(reader or None, None or one line saying what is wrong) for this rank's part.

    The checkpoint must hold this rank's tensors at their full shapes, with as many vocabulary rows, and
    when `model_names` (the whole model's) is known, exactly those: it is loaded whole or not at all."""
    try:
        reader = CheckpointReader(path)
    except ConfigError as e:
        return None, str(e)
    saved_cfg = reader.meta.config or {}
    missing = sorted((model_names or {lt.name for lt in tensors}) - set(reader.tensors))
    if missing:
        return None, _mismatch(path, f"it has no tensor {missing[0]}", model_cfg, saved_cfg)
    extra = sorted(set(reader.tensors) - model_names) if model_names is not None else []
    if extra:
        return None, _mismatch(path, f"it holds {extra[0]}, which this model does not have", model_cfg, saved_cfg)
    for lt in tensors:
        entry = reader.tensors[lt.name]
        saved, rows = tuple(entry.shape), entry.valid_rows
        padding_only = saved[1:] == lt.full_shape[1:] and rows is not None and rows == lt.valid_rows
        if saved != lt.full_shape and not padding_only:
            what = f"tensor {lt.name} has shape {saved}" + (f" ({rows} vocabulary rows)" if rows else "") + \
                f" but the model's is {lt.full_shape}" + (f" ({lt.valid_rows} rows)" if lt.valid_rows else "")
            return None, _mismatch(path, what, model_cfg, saved_cfg)
        if rows is not None and lt.valid_rows is not None and rows != lt.valid_rows:
            return None, _mismatch(path, f"tensor {lt.name} holds {rows} vocabulary rows but the model has "
                                         f"{lt.valid_rows}", model_cfg, saved_cfg)
    needed = reader.model_files(lt.name for lt in tensors)
    if ranges and reader.optimizer is not None and reader.optimizer.name != optimizer_name:
        return None, (f"checkpoint {path} holds {reader.optimizer.name} optimizer state, and this run trains with "
                      f"--optimizer {optimizer_name}; load it with --no-load-optim (the weights only: the "
                      f"{optimizer_name} state starts afresh) or train with --optimizer {reader.optimizer.name}")
    if ranges and reader.optimizer is not None:
        for lt in tensors:
            if lt.local_name not in ranges:
                continue
            if lt.name not in reader.meta.optimizer_tensors:
                return None, f"checkpoint {path} has no optimizer state for {lt.name}; load with --no-load-optim"
            piece = reader.optimizer_piece(lt.name, lt.full_shape, *lt.split(ctx), ranges[lt.local_name])
            needed |= {piece.file} if piece else reader.optimizer_files(lt.name)
    return reader, reader.check_files(needed)


@torch.no_grad()
def _load(reader: CheckpointReader, tensors: list, optimizer, ranges: dict, ctx) -> dict:
    with optimizer.full_weights(writeback=True) if optimizer is not None else contextlib.nullcontext():
        for lt in tensors:
            value = reader.model_slice(lt.name, lt.full_shape, *lt.split(ctx), lt.param.dtype)
            lt.param.detach().copy_(value.view(lt.param.shape))
    if optimizer is not None:
        if ranges and reader.optimizer is not None:
            optimizer.load_state_dict({"step": reader.optimizer.step, "scaler": reader.optimizer.scaler,
                                       "optimizer": reader.optimizer.name,
                                       "params": _LazyOptimizerState(reader, tensors, ranges, ctx)})
        else:
            optimizer.reload_model_params()
    layout, states = reader.meta.layout, reader.meta.rng
    same = (layout.tp, layout.pp, layout.dp, layout.vpp, layout.cp, layout.ep) == (
        ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.vpp_size, ctx.cp_size, ctx.ep_size)
    if same and ctx.rank < len(states) and states[ctx.rank]:
        rng.restore(states[ctx.rank], ctx.rng)
    extra = dict(reader.meta.extra_state)
    extra.setdefault("iteration", reader.iteration)
    extra["config"] = reader.meta.config or {}
    if not same:  # what the resume line says: where the state came from (its RNG streams are not taken)
        extra["saved_layout"] = " x ".join(f"{k} {v}" for k, v in zip(("tp", "cp", "pp", "vpp", "dp", "ep"), (
            layout.tp, layout.cp, layout.pp, layout.vpp, layout.dp, layout.ep)) if v > 1 or k in ("tp", "pp", "dp"))
    return extra


class _LazyOptimizerState(Mapping):
    """Per-parameter optimizer state, read when the optimizer asks for it: one tensor in memory at a time.

    Unchanged split: this rank's saved piece as is. Otherwise: the whole tp slice, resharded (the
    optimizer keeps its own dp range of it).
    """

    def __init__(self, reader: CheckpointReader, tensors: list, ranges: dict, ctx):
        self.reader, self.ranges, self.ctx = reader, ranges, ctx
        self.by_local = {lt.local_name: lt for lt in tensors if lt.local_name in ranges}

    def __getitem__(self, local_name: str) -> dict:
        lt, ctx = self.by_local[local_name], self.ctx
        piece = self.reader.optimizer_piece(lt.name, lt.full_shape, *lt.split(ctx), self.ranges[local_name])
        entry = {"range": tuple(piece.range) if piece else (0, lt.param.numel())}
        for key in OPTIMIZER_KEYS:
            if piece:
                value = self.reader.read_piece(lt.name, key, piece)
            else:
                value = self.reader.optimizer_slice(lt.name, key, lt.full_shape, *lt.split(ctx))
            if value is not None:
                entry[key] = value.reshape(-1)
        return entry

    def __iter__(self):
        return iter(self.by_local)

    def __len__(self) -> int:
        return len(self.by_local)

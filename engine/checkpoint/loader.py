"""Load the newest complete checkpoint into model chunks and optimizer of any layout.

Each rank checks the files it will read (size and sha256 against metadata.json) and the names and
shapes it needs; the ranks then agree, so all of them load the same iteration or all of them stop
with the same one-line error naming the damaged file. With `fallback`, older iterations are tried
newest first. Tensors are read slice by slice (see reader.py), so a changed tp, pp, vpp, dp or
distributed-optimizer setting reshards at load. RNG streams are restored only when the layout is
the one saved, since a stream belongs to a rank's position in that layout.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Optional

import torch

from engine.checkpoint import files, rng
from engine.checkpoint.layout import local_tensors
from engine.checkpoint.reader import CheckpointReader
from engine.config import ConfigError
from engine.parallel.comm import all_gather_object


def latest_iteration(save_dir: str) -> Optional[int]:
    """The iteration `latest_checkpointed_iteration.txt` names, or None (see Checkpointer.latest for a
    run with a save in flight)."""
    return files.read_latest(save_dir)


def load_checkpoint(load_dir: str, model_chunks: list, optimizer, ctx, fallback: bool = False,
                    load_optim: bool = True) -> Optional[dict]:
    """Load into `model_chunks` (and `optimizer`); return the saved extra_state plus `iteration`, or None
    when `load_dir` holds no checkpoint. Raises ConfigError (one line naming the file) on damage.

    The iteration loaded is the one `latest_checkpointed_iteration.txt` names (the newest iteration
    folder if that file is gone); with `fallback`, older complete ones are tried when it is damaged.
    """
    if not os.path.isdir(load_dir):
        raise ConfigError(f"--load {load_dir}: directory not found; check the path or drop --load")
    candidates = _candidates(load_dir, fallback)
    if not candidates:
        return None
    tensors = local_tensors(model_chunks, ctx)
    ranges = {}  # local name -> the flat range of it this rank's optimizer updates
    if optimizer is not None and load_optim:
        ranges = {name: tuple(e["range"]) for name, e in optimizer.state_dict()["params"].items()}
    for n, iteration in enumerate(candidates):
        path = os.path.join(load_dir, files.iter_dir_name(iteration))
        reader, problem = _open_and_check(path, tensors, ranges, ctx)
        problems = [p for p in all_gather_object(problem) if p]
        if not problems:
            return _load(reader, tensors, optimizer, ranges, ctx)
        if n + 1 == len(candidates):
            hint = "" if fallback else "; use --ckpt-fallback to load the newest complete checkpoint instead"
            raise ConfigError(problems[0] + hint)
        if ctx.rank == 0:
            print(f"checkpoint: {problems[0]}; falling back to iteration {candidates[n + 1]}", file=sys.stderr)
    return None


def _candidates(load_dir: str, fallback: bool) -> list:
    latest = files.read_latest(load_dir)
    done = files.list_iterations(load_dir)[::-1]
    if latest is None:
        return done if fallback else done[:1]
    return [latest] + [i for i in done if i != latest] if fallback else [latest]


def _open_and_check(path: str, tensors: list, ranges: dict, ctx) -> tuple:
    """(reader or None, None or one line saying what is wrong) for this rank's part."""
    try:
        reader = CheckpointReader(path)
    except ConfigError as e:
        return None, str(e)
    missing = [lt.name for lt in tensors if lt.name not in reader.tensors]
    if missing:
        return None, (f"checkpoint {path} has no tensor {missing[0]}: it was saved from a different model "
                      "(layers, embeddings or biases differ); use the same model flags")
    for lt in tensors:
        saved = tuple(reader.tensors[lt.name].shape)
        rows = reader.tensors[lt.name].valid_rows
        if saved != lt.full_shape and (saved[1:] != lt.full_shape[1:] or rows is None):
            return None, (f"checkpoint {path}: tensor {lt.name} has shape {saved} but the model's is "
                          f"{lt.full_shape}; use the model flags it was saved with")
    needed = reader.model_files(lt.name for lt in tensors)
    if ranges and reader.optimizer is not None:
        for lt in tensors:
            if lt.local_name not in ranges:
                continue
            if lt.name not in reader.meta.optimizer_tensors:
                return None, f"checkpoint {path} has no optimizer state for {lt.name}; load with --no-load-optim"
            piece = reader.optimizer_piece(lt.name, lt.full_shape, ctx.tp_size, ctx.tp_rank, ranges[lt.local_name])
            needed |= {piece.file} if piece else reader.optimizer_files(lt.name)
    return reader, reader.check_files(needed)


@torch.no_grad()
def _load(reader: CheckpointReader, tensors: list, optimizer, ranges: dict, ctx) -> dict:
    for lt in tensors:
        value = reader.model_slice(lt.name, lt.full_shape, ctx.tp_size, ctx.tp_rank, lt.param.dtype)
        lt.param.detach().copy_(value.view(lt.param.shape))
    if optimizer is not None:
        if ranges and reader.optimizer is not None:
            optimizer.load_state_dict({"step": reader.optimizer.step, "scaler": reader.optimizer.scaler,
                                       "params": _LazyOptimizerState(reader, tensors, ranges, ctx)})
        else:
            optimizer.reload_model_params()
    layout, states = reader.meta.layout, reader.meta.rng
    same = (layout.tp, layout.pp, layout.dp, layout.vpp) == (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.vpp_size)
    if same and ctx.rank < len(states) and states[ctx.rank]:
        rng.restore(states[ctx.rank], ctx.rng)
    extra = dict(reader.meta.extra_state)
    extra.setdefault("iteration", reader.iteration)
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
        piece = self.reader.optimizer_piece(lt.name, lt.full_shape, ctx.tp_size, ctx.tp_rank, self.ranges[local_name])
        entry = {"range": tuple(piece.range) if piece else (0, lt.param.numel())}
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if piece:
                value = self.reader.read_piece(lt.name, key, piece)
            else:
                value = self.reader.optimizer_slice(lt.name, key, lt.full_shape, ctx.tp_size, ctx.tp_rank)
            if value is not None:
                entry[key] = value.reshape(-1)
        return entry

    def __iter__(self):
        return iter(self.by_local)

    def __len__(self) -> int:
        return len(self.by_local)

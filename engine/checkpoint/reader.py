"""Read one saved iteration: its metadata, integrity checks, and any slice of any tensor for any layout.

Model tensors are read slice by slice (files.TensorFile), so a rank reads only the rows it needs.
Optimizer state is saved as flat pieces (dp ranges of each tp shard under the distributed
optimizer): a rank whose split is unchanged reads its own piece; otherwise the pieces of a shard are
joined and reshaped before the same slicing applies.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from engine.checkpoint import files
from engine.checkpoint.layout import assemble
from engine.checkpoint.metadata import FORMAT, CheckpointMeta, OptimizerMeta, OptimPiece
from engine.config import ConfigError


class CheckpointReader:
    def __init__(self, path: str):
        self.path = path
        meta_path = os.path.join(path, files.METADATA_FILE)
        if not os.path.isfile(meta_path):
            raise ConfigError(f"checkpoint {path} is incomplete: {meta_path} is missing")
        try:
            with open(meta_path) as fh:
                raw = json.load(fh)
        except (OSError, ValueError):
            raise ConfigError(f"checkpoint file {meta_path} is damaged (not valid JSON)") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else None
            raise ConfigError(f"{meta_path} is not a Ternion checkpoint's metadata (format {found!r})")
        try:
            self.meta = CheckpointMeta.from_json(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"checkpoint file {meta_path} is damaged ({type(e).__name__}: {e})") from None
        self._handles: dict = {}
        self._joined: dict = {}

    # --- what is in it -------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.meta.iteration

    @property
    def tensors(self) -> dict:
        return self.meta.tensors

    @property
    def optimizer(self) -> Optional[OptimizerMeta]:
        return self.meta.optimizer

    def check_files(self, names) -> Optional[str]:
        """None when every named file is present with its recorded size and sha256; else one line naming the file."""
        for name in sorted(set(names)):
            rec = self.meta.files.get(name)
            path = os.path.join(self.path, name)
            if rec is None:
                return f"checkpoint {self.path} lists no checksum for {name}; the metadata is damaged"
            if not os.path.isfile(path):
                return f"checkpoint file {path} is missing"
            size = os.path.getsize(path)
            if size != rec.bytes:
                return f"checkpoint file {path} is truncated or altered ({size} bytes, {rec.bytes} expected)"
            if files.sha256_file(path) != rec.sha256:
                return f"checkpoint file {path} is damaged (sha256 mismatch)"
        return None

    def model_files(self, names) -> set:
        return {f for name in names for f in self.tensors[name].shards}

    def optimizer_files(self, name: str) -> set:
        return {piece.file for shard in self.meta.optimizer_tensors[name].shards for piece in shard}

    def optimizer_piece(self, name: str, target_shape: tuple, tp_size: int, tp_rank: int,
                        flat_range: tuple) -> Optional[OptimPiece]:
        """The saved piece holding exactly `flat_range` of this rank's slice when the split is unchanged
        (same tp, shape and dp range): the usual resume reads it alone, not every dp rank's piece."""
        entry = self.meta.optimizer_tensors.get(name)
        if entry is None or tuple(entry.shape) != tuple(target_shape):
            return None
        if entry.tp_axis is not None and len(entry.shards) != tp_size:
            return None
        shard = entry.shards[tp_rank if entry.tp_axis is not None else 0]
        return next((piece for piece in shard if tuple(piece.range) == tuple(flat_range)), None)

    def read_piece(self, name: str, key: str, piece: OptimPiece) -> Optional[torch.Tensor]:
        if key not in self.meta.optimizer_tensors[name].keys:
            return None
        return self._file(piece.file).read(f"{name}/{key}")

    # --- reading slices ------------------------------------------------------------------------
    def _file(self, name: str) -> files.TensorFile:
        if name not in self._handles:
            self._handles[name] = files.TensorFile(os.path.join(self.path, name))
        return self._handles[name]

    def model_slice(self, name: str, target_shape: tuple, tp_size: int, tp_rank: int,
                    dtype: torch.dtype) -> torch.Tensor:
        entry = self.tensors[name]

        def read(shard, lo, hi):
            return self._file(entry.shards[shard]).read(name, entry.tp_axis, lo, hi)
        return assemble(entry, tuple(target_shape), tp_size, tp_rank, read, dtype)

    def full(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole global tensor as saved (vocabulary padding of the saving layout included)."""
        entry = self.tensors[name]
        dtype = dtype or files.DTYPE_NAMES[entry.dtype]
        return self.model_slice(name, tuple(entry.shape), 1, 0, dtype)

    def optimizer_slice(self, name: str, key: str, target_shape: tuple, tp_size: int,
                        tp_rank: int) -> Optional[torch.Tensor]:
        """This rank's slice of one optimizer tensor (a key of metadata.OPTIMIZER_KEYS), or None if not saved."""
        entry = self.meta.optimizer_tensors.get(name)
        if entry is None or key not in entry.keys:
            return None

        def read(shard, lo, hi):
            whole = self._join(name, key, shard, entry)
            return whole if lo is None else whole.narrow(entry.tp_axis, lo, hi - lo)
        return assemble(entry, tuple(target_shape), tp_size, tp_rank, read, torch.float32)

    def _join(self, name: str, key: str, shard: int, entry) -> torch.Tensor:
        """One saved tp shard of an optimizer tensor, joined from its dp pieces."""
        cache_key = (name, key, shard)
        if cache_key not in self._joined:
            shape = list(entry.shape)
            if entry.tp_axis is not None:
                shape[entry.tp_axis] //= len(entry.shards)
            flat = torch.empty(torch.Size(shape).numel(), dtype=torch.float32)
            covered = 0
            for piece in entry.shards[shard]:
                lo, hi = piece.range
                flat[lo:hi] = self._file(piece.file).read(f"{name}/{key}")
                covered += hi - lo
            if covered != flat.numel():
                raise ConfigError(f"checkpoint {self.path}: optimizer state of {name} covers {covered} of "
                                  f"{flat.numel()} elements; the metadata is damaged")
            self._joined = {cache_key: flat.view(shape)}  # keep one: readers go tensor by tensor
        return self._joined[cache_key]


def open_iteration(load: str, iteration: Optional[int] = None,
                   choose: str = "pass --iteration N to read another") -> "CheckpointReader":
    """Iteration `iteration` (default: the latest) of the checkpoint directory `load`, every file verified.

    For the offline tools (merge, generate); a user mistake is a ConfigError naming --load, or --iteration
    when one was given. `choose` is the tool's way to pick another saved iteration, said after the list.
    """
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: directory not found; give the --save directory of a run")
    saved = files.list_iterations(load)
    have = f"saved iterations: {', '.join(map(str, saved))}; {choose}" if saved else "no iteration is saved there"
    if iteration is not None:
        path = os.path.join(load, files.iter_dir_name(iteration))
        if not os.path.isdir(path):
            raise ConfigError(f"--iteration {iteration}: {path} not found; {have}")
    else:
        iteration = files.read_latest(load)
        if iteration is None and not saved:
            raise ConfigError(f"--load {load}: holds no checkpoint (no {files.LATEST_FILE}, no iter_NNNNNNN folder); "
                              "give the --save directory of a run that saved one")
        if iteration is None:
            raise ConfigError(f"--load {load}: {files.LATEST_FILE} is missing or unreadable (a save did not "
                              f"finish?); {have}")
        path = os.path.join(load, files.iter_dir_name(iteration))
        if not os.path.isdir(path):
            raise ConfigError(f"--load {load}: {files.LATEST_FILE} names iteration {iteration} but {path} is "
                              f"missing; {have}")
    try:
        reader = CheckpointReader(path)
    except ConfigError as e:
        raise ConfigError(f"{e}; {have}") from None
    problem = reader.check_files(reader.meta.files)
    if problem:
        raise ConfigError(f"{problem}; {have}")
    return reader

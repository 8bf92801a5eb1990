"""Where each tensor of a checkpoint lives, and how a rank of any layout finds its slice.

Every tensor has a global name (the model's parameter names already are layout independent: layers
are keyed by global id) and a global shape, split over TP on at most one axis into equal parts. Two
twists are handled here and nowhere else:
- the last pipeline stage's copy of a tied embedding is the same tensor as the first stage's word
  embedding: it is stored once, under the original's name (its ParamSpec's `copy_of`), and loaded from there;
- the vocabulary is padded to a multiple that depends on tp, so when the padded sizes differ only
  the first `valid_rows` rows are carried over and the new padding is zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine.checkpoint.metadata import ModelShard, OptimPiece, OptimShard, OptimTensorEntry, TensorEntry
from engine.parallel.layers import spec_of


@dataclass
class LocalTensor:
    """One parameter of this rank, with what is needed to place it in the global tensor."""
    chunk: int
    local_name: str  # the name in its model chunk (and in the optimizer's state)
    name: str        # the global name it is stored under
    param: torch.nn.Parameter
    writer: bool     # this rank stores it (one copy per global tensor slice)

    @property
    def tp_axis(self) -> Optional[int]:
        return spec_of(self.param).tp_axis

    @property
    def expert(self) -> bool:
        """A MoE experts tensor: split over the EP group on its expert axis, replicated over tp."""
        return spec_of(self.param).ep_axis is not None

    @property
    def split_axis(self) -> Optional[int]:
        """The axis the checkpoint splits into shards: the expert axis for experts, else the TP axis."""
        return spec_of(self.param).ep_axis if self.expert else self.tp_axis

    def split(self, ctx) -> tuple:
        """(shards, this rank's shard) of the stored split: ep for experts, tp otherwise."""
        return (ctx.ep_size, ctx.ep_rank) if self.expert else (ctx.tp_size, ctx.tp_rank)

    def replica_rank(self, ctx) -> int:
        """This rank's index among the ranks holding the same slice (dp x cp; dp/ep x cp for experts)."""
        return ctx.edp_cp_rank if self.expert else ctx.dp_cp_rank

    @property
    def full_shape(self) -> tuple:
        return tuple(spec_of(self.param).full_shape)

    @property
    def valid_rows(self) -> Optional[int]:
        return spec_of(self.param).valid_rows


def local_tensors(model_chunks: list, ctx) -> list:
    """This rank's parameters in chunk order, each once, with global names and who writes them."""
    out, seen = [], set()
    for c, chunk in enumerate(model_chunks):
        for local_name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            spec = spec_of(p)
            name = spec.copy_of or local_name
            lt = LocalTensor(c, local_name, name, p, False)
            lt.writer = lt.replica_rank(ctx) == 0 and spec.copy_of is None and (ctx.tp_rank == 0 or
                                                                               spec.tp_axis is not None)
            out.append(lt)
    return out


def shard_file(kind: str, tp_rank: int, pp_rank: int, dp_rank: Optional[int] = None) -> str:
    """The file a rank writes: model_tpTT_ppPP.safetensors, or optim_tpTT_ppPP[_dpDDD].safetensors (per dp
    rank only under the distributed optimizer; with context parallelism DDD numbers the dp x cp replicas)."""
    dp = f"_dp{dp_rank:03d}" if dp_rank is not None else ""
    return f"{kind}_tp{tp_rank:02d}_pp{pp_rank:02d}{dp}.safetensors"


def model_shard(lt: LocalTensor, dtype: torch.dtype, shard: int, pp_rank: int, file: str) -> ModelShard:
    """How the metadata describes this rank's slice (`shard`: its tp rank, or ep rank for experts) of one
    model tensor. Experts are stored as one global tensor whose split axis is the global expert id."""
    entry = TensorEntry(list(lt.full_shape), str(dtype).removeprefix("torch."), lt.split_axis, lt.valid_rows, pp_rank,
                        lt.chunk, [], "ep" if lt.expert else "tp")
    return ModelShard(entry, shard, file)


def optim_shard(lt: LocalTensor, keys: list, shard: int, file: str, flat_range) -> OptimShard:
    """How the metadata describes this rank's piece of one parameter's optimizer state."""
    entry = OptimTensorEntry(list(lt.full_shape), lt.split_axis, lt.valid_rows, list(keys), [],
                             "ep" if lt.expert else "tp")
    return OptimShard(entry, shard, OptimPiece(file, list(flat_range)))


def tp_bounds(dim: int, tp_size: int, tp_rank: int) -> tuple:
    per = dim // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def assemble(saved: dict, target_shape: tuple, tp_size: int, tp_rank: int, read: Callable,
             dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice (of a global tensor of `target_shape` split `tp_size` ways) from saved shards.

    `saved`: the tensor's metadata entry (a TensorEntry or OptimTensorEntry: shape, tp_axis, valid_rows,
    and one shard per saved tp rank).
    `read(shard, lo, hi)` returns rows [lo, hi) along the tp axis of saved shard `shard` (its own
    coordinates), or the whole shard when the tensor is replicated (lo = hi = None).
    """
    axis, saved_shape = saved.tp_axis, tuple(saved.shape)
    _check_shapes(saved, target_shape)
    if axis is None:
        return read(0, None, None).to(dtype)
    lo, hi = tp_bounds(target_shape[axis], tp_size, tp_rank)
    local_shape = list(target_shape)
    local_shape[axis] = hi - lo
    same_dim = saved_shape[axis] == target_shape[axis]
    limit = hi if same_dim else min(hi, saved.valid_rows)
    saved_tp = len(saved.shards)
    per_old = saved_shape[axis] // saved_tp
    spans = [(s, max(lo, s * per_old), min(limit, (s + 1) * per_old)) for s in range(saved_tp)]
    spans = [(s, a, b) for s, a, b in spans if a < b]
    if len(spans) == 1 and spans[0][1:] == (lo, hi):  # the common case: one saved shard covers the slice
        s, a, b = spans[0]
        return read(s, a - s * per_old, b - s * per_old).to(dtype)
    out = torch.zeros(local_shape, dtype=dtype)
    for s, a, b in spans:  # one saved piece in memory at a time, besides the result
        out.narrow(axis, a - lo, b - a).copy_(read(s, a - s * per_old, b - s * per_old))
    return out


def _check_shapes(saved: dict, target_shape: tuple) -> None:
    saved_shape = tuple(saved.shape)
    if len(saved_shape) != len(target_shape):
        raise ValueError(f"shape {saved_shape} in the checkpoint, {target_shape} in the model")
    for d, (a, b) in enumerate(zip(saved_shape, target_shape)):
        vocab_axis = d == 0 and saved.valid_rows is not None and saved.tp_axis == 0
        if a != b and not (vocab_axis and min(a, b) >= saved.valid_rows):
            raise ValueError(f"shape {saved_shape} in the checkpoint, {target_shape} in the model")

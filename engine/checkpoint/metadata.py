"""metadata.json as typed records: what a checkpoint holds and where each piece of it lives.

Ranks describe what they write (`ModelShard`, `OptimShard` in a `RankPart`); rank 0 merges every rank's
part into one `CheckpointMeta` (`CheckpointMeta.build`), which is written as JSON. Readers get the same
classes back from `CheckpointMeta.from_json`. The JSON keys are the format's (version 1, unchanged since
the first checkpoints; tests/test_checkpoint_compat.py loads one of those), so a checkpoint written by
any earlier commit reads into these classes.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Optional

FORMAT, VERSION = "ternion-checkpoint", 1
ADDED_KEYS = {"layout": ("cp", "ep")}  # optional keys of version 1 (see CheckpointMeta.to_json)
# A parameter's optimizer tensors, each saved if the optimizer keeps it: Adam's moments or Muon's momentum, and
# the fp32 master where it is not the weight itself
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "momentum", "master")


@dataclass
class TensorEntry:
    """A model tensor: its global shape and split, and the file of each saved tp shard (one if replicated)."""
    shape: list
    dtype: str
    tp_axis: Optional[int]
    valid_rows: Optional[int]  # vocabulary rows that hold tokens (the rest is padding), else None
    pp_rank: int
    vpp_chunk: int
    shards: list
    split: str = "tp"  # what tp_axis is split over: "tp", or "ep" for MoE experts (shards by ep rank)


@dataclass
class OptimPiece:
    file: str
    range: list  # [start, end) of the flat tp shard this piece holds (a dp rank's part, or all of it)


@dataclass
class OptimTensorEntry:
    """The optimizer state of one parameter: per saved tp shard, the pieces it was saved in."""
    shape: list
    tp_axis: Optional[int]
    valid_rows: Optional[int]
    keys: list  # which of OPTIMIZER_KEYS are saved
    shards: list  # [[OptimPiece, ...] per tp shard]
    split: str = "tp"

    @classmethod
    def from_json(cls, d: dict) -> "OptimTensorEntry":
        return cls(**{**d, "shards": [[OptimPiece(**p) for p in shard] for shard in d["shards"]]})


@dataclass
class SavedLayout:
    tp: int
    pp: int
    vpp: int
    dp: int
    world_size: int
    distributed_optimizer: bool
    stage_layers: list  # [pp rank][vpp chunk] -> global layer ids
    cp: int = 1  # context-parallel size (weights replicated over it; optimizer shards over dp x cp)
    ep: int = 1  # expert-parallel size (experts split over it; their optimizer shards over dp/ep x cp)


@dataclass
class OptimizerMeta:
    distributed: bool
    step: int
    scaler: dict
    name: str = "adam"  # whose state it is: adam or muon (--optimizer; written only when not adam)


@dataclass
class FileRecord:
    bytes: int
    sha256: str


@dataclass
class ModelShard:
    """What one rank writes of one model tensor."""
    entry: TensorEntry  # with `shards` empty: filled when parts are merged
    tp_rank: int
    file: str


@dataclass
class OptimShard:
    """What one rank writes of one parameter's optimizer state."""
    entry: OptimTensorEntry  # `shards` empty, as above
    tp_rank: int
    piece: OptimPiece


@dataclass
class RankPart:
    """Everything one rank contributes to the metadata; gathered on rank 0."""
    rank: int
    model: dict = field(default_factory=dict)   # name -> ModelShard
    optim: dict = field(default_factory=dict)   # name -> OptimShard
    files: list = field(default_factory=list)
    optimizer: Optional[OptimizerMeta] = None
    rng: dict = field(default_factory=dict)
    fp8: dict = field(default_factory=dict)  # FP8 amax histories by linear name (engine.fp8.state_dict)


@dataclass
class CheckpointMeta:
    format: str
    version: int
    iteration: int
    consumed_samples: Optional[int]
    layout: SavedLayout
    config: dict
    vocab_size: Optional[int]
    extra_state: dict
    optimizer: Optional[OptimizerMeta]
    tensors: dict            # name -> TensorEntry
    optimizer_tensors: dict  # name -> OptimTensorEntry
    rng: list                # per global rank: engine.checkpoint.rng.capture()
    files: dict              # file name -> FileRecord (filled once every rank has written)
    saved_at: float

    def to_json(self) -> dict:
        """The JSON object. Keys added since version 1 (a layout's cp and ep, a tensor's split, the optimizer's
        name) are written only when they differ from their defaults, so a checkpoint without context or expert
        parallelism, trained with Adam, is byte for byte what earlier commits wrote and read."""
        d = dataclasses.asdict(self)
        for key in ADDED_KEYS["layout"]:
            if d["layout"][key] == 1:
                del d["layout"][key]
        if d["optimizer"] is not None and d["optimizer"]["name"] == "adam":
            del d["optimizer"]["name"]
        for entries in (d["tensors"], d["optimizer_tensors"]):
            for entry in entries.values():
                if entry["split"] == "tp":
                    del entry["split"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CheckpointMeta":
        opt = d.get("optimizer")
        return cls(format=d["format"], version=d["version"], iteration=int(d["iteration"]),
                   consumed_samples=d.get("consumed_samples"), layout=SavedLayout(**d["layout"]), config=d["config"],
                   vocab_size=d.get("vocab_size"), extra_state=d.get("extra_state") or {},
                   optimizer=OptimizerMeta(**opt) if opt else None,
                   tensors={k: TensorEntry(**v) for k, v in d["tensors"].items()},
                   optimizer_tensors={k: OptimTensorEntry.from_json(v)
                                      for k, v in (d.get("optimizer_tensors") or {}).items()},
                   rng=d.get("rng") or [], files={k: FileRecord(**v) for k, v in d["files"].items()},
                   saved_at=d.get("saved_at", 0.0))

    @classmethod
    def build(cls, parts: list, iteration: int, ctx, config: dict, extra_state: dict) -> "CheckpointMeta":
        """The metadata of a checkpoint of layout `ctx` from every rank's part (file records still empty)."""
        tensors, optim = {}, {}
        for part in parts:
            for name, s in part.model.items():
                entry = tensors.setdefault(name, dataclasses.replace(s.entry, shards=[None] * _parts(s.entry, ctx)))
                entry.shards[s.tp_rank] = s.file
            for name, s in part.optim.items():
                entry = optim.setdefault(name, dataclasses.replace(
                    s.entry, shards=[[] for _ in range(_parts(s.entry, ctx))]))
                entry.shards[s.tp_rank].append(s.piece)
        for entry in optim.values():
            for shard in entry.shards:
                shard.sort(key=lambda piece: piece.range[0])
        extra = json.loads(json.dumps(extra_state or {}))  # a JSON round trip: fail now, not in the writer thread
        histories = {name: h for part in parts for name, h in part.fp8.items()}  # each stage's, by global name
        if histories:
            extra["fp8"] = histories
        opt = next((p.optimizer for p in parts if p.optimizer is not None), None)
        layout = SavedLayout(ctx.tp_size, ctx.pp_size, ctx.vpp_size, ctx.dp_size, ctx.world_size,
                             bool(opt and opt.distributed), _stage_layers(tensors, ctx.pp_size), ctx.cp_size,
                             ctx.ep_size)
        return cls(FORMAT, VERSION, iteration, extra.get("consumed_samples"), layout, config,
                   next((e.valid_rows for e in tensors.values() if e.valid_rows), None), extra, opt, tensors, optim,
                   [p.rng for p in sorted(parts, key=lambda p: p.rank)], {}, time.time())


def _parts(entry, ctx) -> int:
    if entry.tp_axis is None:
        return 1
    return ctx.ep_size if entry.split == "ep" else ctx.tp_size


def _stage_layers(tensors: dict, pp: int) -> list:
    """[pp rank][vpp chunk] -> sorted global layer ids, from the layer tensors' places."""
    stages = [[] for _ in range(pp)]
    for name, entry in tensors.items():
        if name.startswith("layers."):
            chunks = stages[entry.pp_rank]
            chunks.extend([] for _ in range(entry.vpp_chunk + 1 - len(chunks)))
            chunks[entry.vpp_chunk].append(int(name.split(".")[1]))
    return [[sorted(set(c)) for c in s] for s in stages]

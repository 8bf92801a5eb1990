"""A Megatron-LM checkpoint as a Ternion checkpoint directory at the same iteration (tools/convert_megatron.py,
and `--load MEGATRON_SAVE` through engine/checkpoint/resume.py).

Everything is checked before anything is written: the arguments (what Ternion does not build is one line), every
tensor the model needs, present under one of its Megatron names with the shape the arguments imply, no model
tensor left over, every shard file whole. Then the tensors are streamed one at a time (tqdm shows them) into one
model file and one optimizer file, saved as tp 1 x pp 1 with whole (replicated) optimizer state, so the result
loads at any layout; the checkpoint layer publishes it atomically (saver.publish). Carried over: the weights, the
fp32 masters and Adam moments with the Adam step and the loss scaler (where optimizer.py reads the layout), the
iteration, the consumed samples (the next sample index) and the LR schedule (the run's arguments). Not carried:
RNG states (Megatron's CUDA RNG tracker states mean nothing to another program's streams) and Megatron's rerun
state machine; the `megatron` entry of the checkpoint's extra state records the source, what came across and
the sha256 of every tensor read.
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch

from engine.checkpoint import files
from engine.checkpoint.hf.transforms import WHOLE
from engine.checkpoint.layout import local_tensors, model_shard, optim_shard, shard_file
from engine.checkpoint.megatron.args import config_from_args
from engine.checkpoint.megatron.optimizer import MegatronOptimizer
from engine.checkpoint.megatron.source import MegatronCheckpoint, open_megatron
from engine.checkpoint.megatron.tables import plan
from engine.checkpoint.metadata import CheckpointMeta, FileRecord, OptimizerMeta, RankPart
from engine.checkpoint.saver import publish
from engine.config import Config, ConfigError, DataConfig
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.validation import validate

_NOT_MODEL = ("optimizer.", "chained_", "rng_state", "rerun_state_machine")


def import_megatron(load: str, out_dir: str, iteration: Optional[int] = None, progress=None) -> tuple:
    """Write iteration `iteration` (default: the latest) of the Megatron-LM save `load` as a Ternion checkpoint in
    `out_dir`; return (the run Config, the MegatronCheckpoint, the lines to tell the user). `progress(total)`, if
    given, makes the progress bar (tqdm) each tensor written ticks."""
    ck = open_megatron(load, iteration)
    cfg = config_from_args(ck.args, ck.path)
    probe = Config.from_dict(cfg.to_dict())
    probe.data = DataConfig(mock_data=True)  # its data files need not be on this machine
    validate(probe, 1)
    ctx = ParallelContext.virtual()
    tensors = [lt for lt in local_tensors(build_model_chunks(cfg, ctx, device="meta"), ctx) if lt.writer]
    sources = _sources(ck, cfg.model, tensors)
    optimizer = MegatronOptimizer(ck, {name: where for name, (where, _) in sources.items()})
    consumed = int(getattr(ck.args, "consumed_train_samples", 0) or 0)
    with files.staged(out_dir, ck.iteration) as tmp:
        part, digests = RankPart(0), {}
        bar = progress(len(tensors) * (4 if optimizer.present else 1)) if progress is not None else None
        records = _write_model(ck, tensors, sources, tmp, part, digests, bar)
        if optimizer.present:
            records.update(_write_optimizer(ck, optimizer, tensors, sources, tmp, part, bar))
            part.optimizer = OptimizerMeta(False, optimizer.step(), optimizer.scaler(cfg.training.fp16))
        extra = {"consumed_samples": consumed, "data": {"consumed_samples": consumed},
                 "megatron": {"source": os.path.abspath(ck.path), "format": ck.format, "iteration": ck.iteration,
                              "optimizer": optimizer.why_not or "carried", "rng": "not carried", "sha256": digests}}
        meta = CheckpointMeta.build([part], ck.iteration, ctx, cfg.to_dict(), extra)
        meta.files = records
        if bar is not None:
            bar.close()
        publish(out_dir, tmp, ck.iteration, meta)
    notes = _notes(ck, optimizer, consumed)
    return cfg, ck, notes


def _sources(ck: MegatronCheckpoint, m, tensors: list) -> dict:
    """Ternion name -> ((stored key, leading indices), Transform), every shape checked, nothing left over."""
    entries, out, used = {e.ours: e for e in plan(m)}, {}, set()
    for lt in tensors:
        entry = entries[lt.name]
        where = ck.locate(entry.names)
        if where is None:
            raise ConfigError(f"{ck.path}: no tensor {entry.names[0]}, which its args imply (Ternion's {lt.name})")
        shape = (lt.valid_rows,) + lt.full_shape[1:] if lt.valid_rows else lt.full_shape
        want = entry.how.out_shape(shape)
        if ck.shape(where) != want:
            raise ConfigError(f"{ck.path}: {where[0]} has shape {ck.shape(where)} where its args imply {want}")
        out[lt.name] = (where, entry.how)
        used |= {found[0] for name in entry.names if (found := ck.locate((name,)))}  # both specs' names, if both
    tied = not m.untie_embeddings_and_output_weights
    left = [k for k in ck.tensors.shapes if k not in used and not k.startswith(_NOT_MODEL)
            and not k.endswith("_extra_state") and not (tied and k == "output_layer.weight")]
    if left:
        raise ConfigError(f"{ck.path}: tensor {left[0]} has no place in the Ternion model its args describe")
    return out


def _write_model(ck, tensors: list, sources: dict, tmp: str, part: RankPart, digests: dict, progress) -> dict:
    name = shard_file("model", 0, 0)
    dtypes = {lt.name: ck.tensors.dtypes[sources[lt.name][0][0]] for lt in tensors}
    specs = [(lt.name, dtypes[lt.name], lt.full_shape) for lt in tensors]

    def produce():
        for lt in tensors:
            where, how = sources[lt.name]
            value = ck.read(where)
            digests[lt.name] = hashlib.sha256(value.contiguous().view(torch.uint8).numpy()).hexdigest() \
                if value.numel() else ""
            _tick(progress)
            yield lt.name, _placed(lt, how, value, dtypes[lt.name])
    part.model = {lt.name: model_shard(lt, dtypes[lt.name], 0, 0, name) for lt in tensors}
    return _written(tmp, name, specs, produce(), part)


def _write_optimizer(ck, optimizer, tensors: list, sources: dict, tmp: str, part: RankPart, progress) -> dict:
    """exp_avg, exp_avg_sq and master of every parameter, flat fp32 over the whole tensor (range [0, numel))."""
    name, items = shard_file("optim", 0, 0), []
    for lt in tensors:
        where, how = sources[lt.name]
        located = optimizer.keys_for(where)
        if located is None:
            raise ConfigError(f"{ck.path}: no optimizer state for {where[0]} (Ternion's {lt.name}); the optimizer "
                              "state is incomplete")
        keys = [k for k in ("exp_avg", "exp_avg_sq", "master") if k in located]
        items += [(lt, k, located[k], how) for k in keys]
        part.optim[lt.name] = optim_shard(lt, keys, 0, name, (0, torch.Size(lt.full_shape).numel()))
    specs = [(f"{lt.name}/{k}", torch.float32, (torch.Size(lt.full_shape).numel(),)) for lt, k, _, _ in items]

    def produce():
        for lt, k, located, how in items:
            _tick(progress)
            yield f"{lt.name}/{k}", _placed(lt, how, optimizer.read(located), torch.float32).reshape(-1)
    return _written(tmp, name, specs, produce(), part)


def _placed(lt, how, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our tensor from Megatron's `value`: the value itself where nothing changes (no second copy in memory),
    else a new tensor (transformed, or with our vocabulary padding)."""
    if how is WHOLE and tuple(value.shape) == lt.full_shape and value.dtype == dtype:
        return value
    full = torch.zeros(lt.full_shape, dtype=dtype)
    how.into(full[: lt.valid_rows] if lt.valid_rows else full, value)
    return full


def _written(tmp: str, name: str, specs: list, produced, part: RankPart) -> dict:
    """Write one safetensors file of the new checkpoint; its FileRecord."""
    sha = files.write_safetensors(os.path.join(tmp, name), specs, produced)
    part.files.append(name)
    return {name: FileRecord(os.path.getsize(os.path.join(tmp, name)), sha)}


def _tick(progress) -> None:
    if progress is not None:
        progress.update(1)


def _notes(ck, optimizer, consumed: int) -> list:
    notes = [f"read Megatron-LM {ck.format} iteration {ck.iteration} ({ck.path}); {consumed} samples consumed, so "
             f"the next sample index is {consumed}"]
    if not optimizer.present:
        notes.append(f"optimizer state not carried: {optimizer.why_not}; a resume starts Adam afresh")
    notes.append("RNG states are not carried (Megatron's CUDA RNG tracker means nothing to Ternion's streams): "
                 "dropout masks after the resume differ from Megatron's")
    return notes

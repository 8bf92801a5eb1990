"""Offline conversions of a saved checkpoint, one tensor at a time: merge into one unsharded file, or
split into another (tp, pp) layout. Used by tools/merge_ckpt.py.

Native merged format: `model.safetensors` holding every global tensor whole, with the vocabulary
padding removed (so it does not depend on any tp), and `config.json` holding the run config, the
vocabulary size and the iteration. `load_merged` puts it into model chunks of any layout.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from engine.checkpoint import files
from engine.checkpoint.layout import assemble, local_tensors, model_shard, optim_shard, shard_file
from engine.checkpoint.metadata import CheckpointMeta, FileRecord, RankPart, TensorEntry
from engine.checkpoint.reader import CheckpointReader
from engine.checkpoint.saver import publish
from engine.config import Config, ConfigError
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.validation import check_model_split

MERGED_WEIGHTS = "model.safetensors"
MERGED_CONFIG = "config.json"
MERGED_FORMAT = "ternion-merged"


def unpadded(reader: CheckpointReader, name: str) -> tuple:
    """(shape, dtype) of a global tensor without vocabulary padding."""
    entry = reader.tensors[name]
    shape = list(entry.shape)
    if entry.valid_rows is not None:
        shape[0] = entry.valid_rows
    return tuple(shape), files.DTYPE_NAMES[entry.dtype]


def full_unpadded(reader: CheckpointReader, name: str) -> torch.Tensor:
    """A whole global tensor; only the valid vocabulary rows are read, so the peak is one unpadded tensor."""
    shape, dtype = unpadded(reader, name)
    return reader.model_slice(name, shape, 1, 0, dtype)


def merge_native(reader: CheckpointReader, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(reader.tensors)
    specs = [(n, dtype, shape) for n, shape, dtype in ((n, *unpadded(reader, n)) for n in names)]
    files.write_safetensors(os.path.join(out_dir, MERGED_WEIGHTS), specs,
                            ((n, full_unpadded(reader, n)) for n in names), metadata={"format": "pt"})
    config = {"format": MERGED_FORMAT, "iteration": reader.iteration, "vocab_size": reader.meta.vocab_size,
              "config": reader.meta.config}
    files.write_json_durable(os.path.join(out_dir, MERGED_CONFIG), config)


@torch.no_grad()
def load_merged(path: str, model_chunks: list, ctx) -> dict:
    """Load a native merged checkpoint (a folder from merge_ckpt.py) into model chunks; return its config.json."""
    weights, cfg_path = os.path.join(path, MERGED_WEIGHTS), os.path.join(path, MERGED_CONFIG)
    if not (os.path.isfile(weights) and os.path.isfile(cfg_path)):
        raise ConfigError(f"{path} is not a merged checkpoint ({MERGED_WEIGHTS} and {MERGED_CONFIG} expected); "
                          "make one with tools/merge_ckpt.py")
    with open(cfg_path) as fh:
        config = json.load(fh)
    weights_file = files.TensorFile(weights)
    for lt in local_tensors(model_chunks, ctx):
        if lt.name not in weights_file.entries:
            raise ConfigError(f"{weights} has no tensor {lt.name}; the model flags differ from the merged model's")
        saved = TensorEntry(list(weights_file.shape(lt.name)), "", lt.tp_axis, lt.valid_rows, 0, 0, [MERGED_WEIGHTS])

        def read(_, lo, hi, name=lt.name, axis=lt.tp_axis):
            return weights_file.read(name, axis, lo, hi)
        try:
            value = assemble(saved, lt.full_shape, ctx.tp_size, ctx.tp_rank, read, lt.param.dtype)
        except ValueError as e:
            raise ConfigError(f"{weights}: tensor {lt.name}: {e}; use the model flags of the merged model") from None
        lt.param.detach().copy_(value)
    return config


def split(reader: CheckpointReader, out_dir: str, tp: int, pp: int) -> None:
    """Write the checkpoint again for layout tp x pp (dp 1, replicated optimizer), in the usual format."""
    cfg = Config.from_dict(reader.meta.config)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.virtual_pipeline_model_parallel_size = cfg.parallel.pipeline_schedule = None
    cfg.parallel.use_distributed_optimizer, cfg.parallel.data_parallel_sharding_strategy = False, None
    cfg.parallel.decoder_first_pipeline_num_layers = cfg.parallel.decoder_last_pipeline_num_layers = None
    check_model_split(cfg.model, tp, pp, tp_flag="--target-tp", pp_flag="--target-pp")
    with files.staged(out_dir, reader.iteration) as tmp:  # a failure leaves no .tmp behind
        parts, checksums = [], {}
        for rank in range(tp * pp):
            vctx = ParallelContext.virtual(tp=tp, pp=pp, tp_rank=rank % tp, pp_rank=rank // tp)
            chunks = build_model_chunks(cfg, vctx, vocab_size=reader.meta.vocab_size, device="meta")
            part, written = _split_rank(reader, vctx, chunks, tmp)
            checksums.update(written)
            parts.append(part)
        meta = CheckpointMeta.build(parts, reader.iteration, ParallelContext.virtual(tp=tp, pp=pp), cfg.to_dict(),
                                    reader.meta.extra_state)
        meta.files = checksums
        publish(out_dir, tmp, reader.iteration, meta)


def _split_rank(reader: CheckpointReader, vctx, chunks: list, tmp: str) -> tuple:
    """Write one rank's model and optimizer files of the new layout; (its RankPart, {file: FileRecord})."""
    t, p, tp = vctx.tp_rank, vctx.pp_rank, vctx.tp_size
    part, written = RankPart(vctx.rank), {}
    model_file, optim_file = shard_file("model", t, p), shard_file("optim", t, p)
    model, optim = [], []  # (key, dtype, shape, producer of the tensor) per file
    for lt in (lt for lt in local_tensors(chunks, vctx) if lt.writer):
        dtype = files.DTYPE_NAMES[reader.tensors[lt.name].dtype]
        model.append((lt.name, dtype, tuple(lt.param.shape),
                      lambda lt=lt, dtype=dtype: reader.model_slice(lt.name, lt.full_shape, tp, t, dtype)))
        part.model[lt.name] = model_shard(lt, dtype, t, p, model_file)
        saved = reader.meta.optimizer_tensors.get(lt.name) if reader.optimizer is not None else None
        if saved is None:
            continue
        for key in saved.keys:
            optim.append((f"{lt.name}/{key}", torch.float32, (lt.param.numel(),),
                          lambda lt=lt, k=key: reader.optimizer_slice(lt.name, k, lt.full_shape, tp, t).reshape(-1)))
        part.optim[lt.name] = optim_shard(lt, saved.keys, t, optim_file, (0, lt.param.numel()))
    for name, items in ((model_file, model), (optim_file, optim)):
        if items:
            path = os.path.join(tmp, name)
            sha = files.write_safetensors(path, [i[:3] for i in items], ((i[0], i[3]()) for i in items))
            written[name] = FileRecord(os.path.getsize(path), sha)
            part.files.append(name)
    if reader.optimizer is not None:
        part.optimizer = dataclasses.replace(reader.optimizer, distributed=False)
    return part, written

"""Import (tools/convert_hf.py): a transformers folder as iteration 0 of a checkpoint directory (saved at tp 1 x
pp 1; it loads at any layout), each of our tensors gathered from its HF tensors through the family's plan.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from engine.checkpoint import files
from engine.checkpoint.hf.config_json import imported_config
from engine.checkpoint.hf.families import FAMILIES
from engine.checkpoint.hf.io import HFWeights, read_json
from engine.checkpoint.layout import local_tensors, model_shard, shard_file
from engine.checkpoint.metadata import CheckpointMeta, FileRecord, RankPart
from engine.checkpoint.saver import publish
from engine.config import ConfigError
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks

_UNUSED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers some checkpoints hold


def import_hf(hf_dir: str, out_dir: str, seq_length: Optional[int] = None, data: Optional[dict] = None) -> tuple:
    """Write the transformers model in `hf_dir` as iteration 0 of the checkpoint directory `out_dir`; return (the
    run Config, the names of the model flags that describe it). `data`: DataConfig fields to record (the
    tokenizer). Names and shapes are all checked before writing."""
    arch, cfg, names = imported_config(read_json(os.path.join(hf_dir, "config.json")), seq_length)
    for name, value in (data or {}).items():
        setattr(cfg.data, name, value)
    m, weights, ctx = cfg.model, HFWeights(hf_dir), ParallelContext.virtual()
    tensors = [lt for lt in local_tensors(build_model_chunks(cfg, ctx, device="meta"), ctx) if lt.writer]
    sources = _sources(FAMILIES[arch].plan(m), tensors, weights, m, hf_dir, FAMILIES[arch].left_out(m))
    for prefix, why in FAMILIES[arch].left_out(m):
        if any(k.startswith(prefix) for k in weights.where):
            cfg.notices.append(f"left out the tensors {prefix}*: {why}")
    dtypes = {lt.name: weights.dtype(sources[lt.name][0][0]) for lt in tensors}
    name = shard_file("model", 0, 0)
    with files.staged(out_dir, 0) as tmp:  # a failure (a full or read-only --out) leaves nothing behind
        specs = [(lt.name, dtypes[lt.name], lt.full_shape) for lt in tensors]
        produced = ((lt.name, _gather(lt, sources[lt.name], weights, dtypes[lt.name])) for lt in tensors)
        sha = files.write_safetensors(os.path.join(tmp, name), specs, produced)
        part = RankPart(0, model={lt.name: model_shard(lt, dtypes[lt.name], 0, 0, name) for lt in tensors},
                        files=[name])
        meta = CheckpointMeta.build([part], 0, ctx, cfg.to_dict(), {"consumed_samples": 0})
        meta.files = {name: FileRecord(os.path.getsize(os.path.join(tmp, name)), sha)}
        publish(out_dir, tmp, 0, meta)
    return cfg, names


def _sources(plan: list, tensors: list, weights: HFWeights, m, hf_dir: str, left_out: tuple = ()) -> dict:
    """Our name -> [(HF key, Transform)]; every HF tensor present with the shape config.json implies, none left
    over."""
    sources, used = {}, set()
    for hf_name, ours, how in plan:
        key = weights.key(hf_name)
        if key is None:
            raise ConfigError(f"--hf {hf_dir}: no tensor {hf_name}, which its config.json implies")
        sources.setdefault(ours, []).append((key, how))
        used.add(key)
    for lt in tensors:
        shape = (lt.valid_rows,) + lt.full_shape[1:] if lt.valid_rows else lt.full_shape
        for key, how in sources[lt.name]:
            want = how.out_shape(shape)
            if weights.shape(key) != want:
                raise ConfigError(f"--hf {hf_dir}: tensor {key} has shape {weights.shape(key)} but its config.json "
                                  f"implies {want}")
    if not m.untie_embeddings_and_output_weights:
        used.add("lm_head.weight")  # the tied output layer: some files hold a copy of the embedding
    left = [k for k in weights.where if k not in used and not k.endswith(_UNUSED)
            and not k.startswith(tuple(prefix for prefix, _ in left_out))]
    if left:
        raise ConfigError(f"--hf {hf_dir}: tensor {left[0]} has no place in a Ternion model of its config.json")
    return sources


def _gather(lt, sources: list, weights: HFWeights, dtype: torch.dtype) -> torch.Tensor:
    """One of our tensors, whole and vocabulary-padded, from its HF tensors (one of them in memory at a time)."""
    full = torch.zeros(lt.full_shape, dtype=dtype)
    for key, how in sources:
        how.into(full[: lt.valid_rows] if lt.valid_rows else full, weights.read(key).to(dtype))
    return full

"""Reading a transformers model folder: config.json, and the safetensors (one file, or the shards an index
names) one tensor at a time.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from engine.checkpoint import files
from engine.config import ConfigError

WEIGHTS = "model.safetensors"
_CODE_DTYPES = {code: dtype for dtype, code in files.DTYPE_CODES.items()}


def read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError:
        raise ConfigError(f"{path} not found; --hf takes a folder written by save_pretrained") from None
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON") from None


class HFWeights:
    """The tensors of a transformers folder: model.safetensors, or the shards model.safetensors.index.json names.

    Plain reads (files.TensorFile), one tensor at a time. Names are found with or without the `model.` /
    `transformer.` prefix (a GPT-2 saved as GPT2Model, as the original one is, has none)."""

    def __init__(self, hf_dir: str):
        index, single = os.path.join(hf_dir, "model.safetensors.index.json"), os.path.join(hf_dir, WEIGHTS)
        if os.path.isfile(index):
            shards = {name: os.path.join(hf_dir, f) for name, f in (read_json(index).get("weight_map") or {}).items()}
        elif os.path.isfile(single):
            shards = dict.fromkeys(files.TensorFile(single).keys(), single)
        else:
            raise ConfigError(f"--hf {hf_dir}: no {WEIGHTS} or model.safetensors.index.json; save the model with "
                              "save_pretrained (safetensors is its default)")
        opened = {}
        for path in sorted(set(shards.values())):
            if not os.path.isfile(path):
                raise ConfigError(f"--hf {hf_dir}: {path}, named by model.safetensors.index.json, is missing")
            opened[path] = files.TensorFile(path)
        self.where = {name: opened[path] for name, path in shards.items()}
        absent = [name for name, f in self.where.items() if name not in f.entries]
        if absent:
            raise ConfigError(f"--hf {hf_dir}: tensor {absent[0]} is not in {shards[absent[0]]}, where the index "
                              "puts it")

    def key(self, name: str) -> Optional[str]:
        if name in self.where:
            return name
        short = name.split(".", 1)[1] if name.startswith(("model.", "transformer.")) else None
        return short if short in self.where else None

    def shape(self, key: str) -> tuple:
        return self.where[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return _CODE_DTYPES[self.where[key].entries[key]["dtype"]]

    def read(self, key: str) -> torch.Tensor:
        return self.where[key].read(key)

"""Megatron-LM checkpoints in and out, read and written by this package's own code (Megatron is never imported).

In (`import_megatron`, tools/convert_megatron.py and `--load MEGATRON_SAVE`): a Megatron-LM save directory in the
`torch_dist` format (torch_dist.py, read with torch.distributed.checkpoint) or the legacy `torch` format
(legacy.py), found by its files (source.py), becomes a Ternion checkpoint at the same iteration (importer.py),
written by the checkpoint layer so it loads at any layout. Its saved `args` become Ternion flags (args.py), its
tensors map through one table for every architecture (tables.py), and the distributed optimizer's state comes
across where its layout is read (optimizer.py: the model-space layouts; bucket_space.py: the bucket layout).
Out (`export_megatron`, `--to-megatron`): a Ternion checkpoint as torch_dist that megatron-core's
dist_checkpointing.load reads (exporter.py). Pickled Megatron files are read without running their code
(pickled.py).

The names below are loaded on first use: every `--load` passes through this package (source.py tells the
formats apart), and the torch_dist reader and writer import torch.distributed.checkpoint, about a second of
start-up that a run not converting anything should not pay.
"""
import importlib

_WHERE = {"import_megatron": "importer", "export_megatron": "exporter", "megatron_format": "source",
          "open_megatron": "source"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)

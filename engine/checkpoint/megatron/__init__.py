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
"""
from engine.checkpoint.megatron.exporter import export_megatron
from engine.checkpoint.megatron.importer import import_megatron
from engine.checkpoint.megatron.source import megatron_format, open_megatron

__all__ = ["import_megatron", "export_megatron", "megatron_format", "open_megatron"]

"""Megatron-LM's `torch_dist` format, read with torch.distributed.checkpoint (no Megatron import).

An iteration folder holds PyTorch-DCP shards (`__R_T.distcp`) described by `.metadata`, plus Megatron's own
`common.pt` (everything that is not a sharded tensor: args, iteration, scheduler, the optimizer's param groups)
and `metadata.json` (`{"sharded_backend": "torch_dist", ...}`, which is what marks the format). Every tensor is
stored under its global key and shape, whatever layout saved it: a transformer layer's tensors are stacked,
[num_layers, ...] under `decoder.layers.<name>`, and routed experts add an expert axis, [num_layers, E, ...].

`TorchDist.read(key, lead)` reads the slice at leading indices `lead` (a layer, or a layer and an expert) through
DCP's own resharding read (a load planner that asks for that region only), so memory holds one layer's tensor,
not the stacked one. Before anything is read every shard file named by `.metadata` is checked to exist and to be
long enough, so a missing or truncated shard is one line before a conversion writes anything.
"""
from __future__ import annotations

import os
import warnings
import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from engine.checkpoint.megatron.marks import COMMON_FILE, DCP_METADATA
from engine.checkpoint.megatron.pickled import load_bytes, load_file
from engine.config import ConfigError



class _CachedReader(FileSystemReader):
    """.metadata is read (unpickled) once, not once per tensor."""
    _metadata = None

    def read_metadata(self):
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _RegionPlanner(LoadPlanner):
    """Reads the requested regions of stored tensors into given buffers, and the requested byte items."""

    def __init__(self, regions: list, objects: list):
        self.regions, self.objects, self.found = regions, objects, {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items, self.dest = [], {}
        for fqn, offsets, out in self.regions:
            chunk = ChunkStorageMetadata(torch.Size(offsets), out.shape)
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            self.dest[(fqn, tuple(offsets))] = out
        for fqn in self.objects:
            zero = torch.Size((0,))
            items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), zero, MetadataIndex(fqn), zero, zero))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list) -> list:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        self.found[read_item.dest_index.fqn] = load_bytes(value.read())

    def resolve_tensor(self, read_item) -> torch.Tensor:
        out = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, start, length)
        return out

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class TorchDist:
    """One torch_dist iteration folder: its common state, its tensors' global shapes, and reads of them."""

    def __init__(self, path: str):
        self.path = path
        self.common = load_file(os.path.join(path, COMMON_FILE), "Megatron's common state")
        self._reader = _CachedReader(path)
        try:
            self.metadata = self._reader.read_metadata()
        except FileNotFoundError:
            raise ConfigError(f"{os.path.join(path, DCP_METADATA)} is missing (the shards' index)") from None
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
            raise ConfigError(f"{os.path.join(path, DCP_METADATA)} is damaged ({type(e).__name__})") from None
        entries = self.metadata.state_dict_metadata
        self.shapes = {k: tuple(m.size) for k, m in entries.items() if isinstance(m, TensorStorageMetadata)}
        self.dtypes = {k: m.properties.dtype for k, m in entries.items() if isinstance(m, TensorStorageMetadata)}
        self.object_keys = [k for k, m in entries.items() if isinstance(m, BytesStorageMetadata)]
        self._check_shards()

    def _check_shards(self) -> None:
        """Every shard file .metadata names is there and holds every byte range it points into."""
        needed = {}
        for info in self.metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            path = os.path.join(self.path, name)
            if not os.path.isfile(path):
                raise ConfigError(f"{path} is missing (a shard .metadata names); copy the whole iteration folder")
            if os.path.getsize(path) < end:
                raise ConfigError(f"{path} is truncated ({os.path.getsize(path)} bytes; .metadata points to byte "
                                  f"{end}); copy it again")

    def read(self, key: str, lead: tuple = ()) -> torch.Tensor:
        """The stored tensor `key`, or its slice at leading indices `lead` (leading axes dropped)."""
        shape = self.shapes[key]
        offsets = tuple(lead) + (0,) * (len(shape) - len(lead))
        out = torch.empty((1,) * len(lead) + shape[len(lead):], dtype=self.dtypes[key])
        self._load([(key, offsets, out)], [])
        return out.reshape(shape[len(lead):])

    def read_region(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        """The block of `key` at `offsets` of extent `sizes`."""
        out = torch.empty(sizes, dtype=self.dtypes[key])
        self._load([(key, tuple(offsets), out)], [])
        return out

    def objects(self, keys: list) -> dict:
        """Megatron's sharded objects (pickled byte items) by key."""
        planner = self._load([], list(keys))
        return planner.found

    def _load(self, regions: list, objects: list) -> _RegionPlanner:
        planner = _RegionPlanner(regions, objects)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process reads, as meant
                load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except Exception as e:  # noqa: BLE001 - DCP wraps a shard's read error in its own exception
            what = regions[0][0] if regions else objects[0]
            raise ConfigError(f"{self.path}: {what} could not be read ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[-1][:200]}); the shard is damaged") from None
        return planner

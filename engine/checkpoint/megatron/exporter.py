"""A Ternion checkpoint as a Megatron-LM `torch_dist` save directory (tools/convert_megatron.py --to-megatron).

Written with torch.distributed.checkpoint (`.metadata` and `__0_0.distcp`) through a save planner that names
each piece of Megatron-Core's layout at the target tp x pp (a layer's slice of a stacked tensor, one tp rank's
rows or columns, SwiGLU's linear_fc1 as a gate block and an up block per rank; cut further into pieces of at most
16 MiB, one expert a piece for routed experts) and makes it only when the writer asks for it, from the Ternion
checkpoint's own slices (CheckpointReader.model_slice): memory holds about one piece (torch's writer would keep
every piece it wrote until its file is done; the planner frees each once written). Beside them: Megatron's `common.pt` (args, iteration, checkpoint_version 3.0) and `metadata.json`, and
latest_checkpointed_iteration.txt once the iteration folder is complete (written as iter_N.tmp, renamed).

The args are those of a Megatron-LM run of the model at that tp x pp (args.py): `--load` in Megatron-LM takes
the weights, the iteration and the consumed samples. The optimizer state is not written (`no_save_optim`), so
Megatron-LM starts Adam afresh from these weights; RNG states are not written either.
"""
from __future__ import annotations

import io
import os
import warnings

import torch
from torch.distributed.checkpoint import FileSystemWriter, save
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from engine.checkpoint import files
from engine.checkpoint.megatron.args import args_from_config
from engine.checkpoint.megatron.tables import EXPERTS_KEY, FLATTENED, homogeneous, plan, split_layer, tp_axis
from engine.checkpoint.megatron.marks import BACKEND_FILE, COMMON_FILE
from engine.checkpoint.reader import CheckpointReader
from engine.config import Config
from engine.validation import check_model_split

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
PIECE_BYTES = 16 << 20  # what one piece (one DCP chunk, made and written at once) holds at most


class _LazyPlanner(SavePlanner):
    """Plans the given pieces and makes each tensor only when the storage writer resolves it."""

    def __init__(self, pieces: list, objects: list, progress=None):
        self.pieces, self.objects, self.progress, self.last = pieces, objects, progress, None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items, self.make = [WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO) for key in self.objects], {}
        for key, size, offsets, sizes, dtype, make in self.pieces:
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size(size))
            items.append(WriteItem(MetadataIndex(key, torch.Size(offsets)), WriteItemType.SHARD, tensor_data=data))
            self.make[(key, tuple(offsets))] = make
        return SavePlan(items)

    def create_global_plan(self, all_plans: list) -> tuple:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if self.last is not None:
            # torch's FileSystemWriter keeps every tensor it wrote in a dict per file (for its safetensors format);
            # with its serial loader (per_thread_copy_ahead=0) the previous piece is written by now: free it.
            self.last.untyped_storage().resize_(0)
            self.last = None
        if write_item.type == WriteItemType.BYTE_IO:  # a module's _extra_state, as megatron-core packs it
            data = io.BytesIO()
            torch.save([None], data)
            data.seek(0)
            return data
        if self.progress is not None:
            self.progress.update(1)
        self.last = self.make[(write_item.index.fqn, tuple(write_item.index.offset))]().clone()  # storage of its own
        return self.last


def _pieces(reader: CheckpointReader, m, tp: int) -> list:
    """(stored key, global shape, offsets, sizes, dtype, maker) of every piece, Megatron-Core's layout at tp."""
    out, stacked = [], homogeneous(m)
    for entry in plan(m):
        saved = reader.tensors[entry.ours]
        dtype = files.DTYPE_NAMES[saved.dtype]
        ours = (saved.valid_rows or saved.shape[0],) + tuple(saved.shape[1:]) if saved.valid_rows else tuple(
            saved.shape)
        names = entry.names if entry.both else entry.names[:1]
        for name in names:
            layer, rest = split_layer(name)
            key = f"decoder.layers.{rest}" if stacked and layer is not None else name
            lead = (layer,) if stacked and layer is not None else ()
            out += _split(reader, entry, key, lead, m, tp, ours, dtype)
    return out


def _split(reader, entry, key: str, lead: tuple, m, tp: int, ours: tuple, dtype) -> list:
    """One tensor's pieces: its tp slices (for the vocabulary: padded for tp, as Megatron-Core pads it), each cut
    along the same axis into pieces of at most PIECE_BYTES; routed experts one expert a piece."""
    shape = list(entry.how.out_shape(ours))
    if key.endswith("word_embeddings.weight") or key == "output_layer.weight":
        shape[0] = m.padded_vocab_size(tp)
    size = tuple(lead and (m.num_layers,)) + tuple(shape)
    if EXPERTS_KEY in key:
        return [_piece(reader, entry, key, lead, size, dtype, axis=0, offset=e, length=1, parts=ours[0], part=e)
                for e in range(ours[0])]
    axis = tp_axis(key)
    if axis is None:
        return [_piece(reader, entry, key, lead, size, dtype)]
    blocks = 2 if entry.how is FLATTENED else 1  # SwiGLU: each rank's rows are a gate block and an up block
    per = shape[axis] // (tp * blocks)
    cuts, row_bytes = 1, torch.Size(shape).numel() // shape[axis] * torch.empty((), dtype=dtype).element_size()
    while per * row_bytes > cuts * PIECE_BYTES and per % (2 * cuts) == 0:
        cuts *= 2
    return [_piece(reader, entry, key, lead, size, dtype, axis, offset=((b * tp + t) * cuts + j) * (per // cuts),
                   length=per // cuts, parts=tp * cuts, part=t * cuts + j, block=b if blocks == 2 else None)
            for t in range(tp) for b in range(blocks) for j in range(cuts)]


def _piece(reader, entry, key: str, lead: tuple, size: tuple, dtype, axis=None, offset=0, length=0, parts=1, part=0,
           block=None) -> tuple:
    """One piece: `length` rows from `offset` along `axis` (None: the whole tensor) of the stored tensor of global
    `size`, made from part `part` of our tensor split `parts` ways along its own split axis (and its stacked
    `block`, SwiGLU's gate or up)."""
    shape = list(size[len(lead):])
    offsets, sizes = [0] * len(shape), list(shape)
    if axis is not None:
        offsets[axis], sizes[axis] = offset, length

    def make(name=entry.ours, how=entry.how):
        saved = reader.tensors[name]
        rows = shape[0] if saved.valid_rows else saved.shape[0]  # the vocabulary as padded for the target tp
        local = reader.model_slice(name, (rows, *saved.shape[1:]), parts, part, files.DTYPE_NAMES[saved.dtype])
        return how.out(local) if block is None else local[block]
    return (key, size, tuple(lead) + tuple(offsets), (1,) * len(lead) + tuple(sizes), dtype, _lifted(make, len(lead)))


def _layer_modules(m, moe: bool) -> list:
    """A layer's modules (relative names) that carry an `_extra_state`, both specs' (a loader ignores the rest)."""
    if m.multi_latent_attention:
        q = ["linear_q_down_proj", "linear_q_up_proj"] if m.q_lora_rank else ["linear_q_proj"]
        attention = ["linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj", "core_attention"]
    else:
        attention = ["linear_proj", "linear_qkv", "core_attention"]
    names = [f"self_attention.{n}" for n in attention]
    if moe:
        return names + [f"mlp.shared_experts.linear_fc{n}" for n in (1, 2) if m.moe_shared_expert_intermediate_size]
    return names + ["mlp.linear_fc1", "mlp.linear_fc2"]


def _extra_states(m) -> list:
    """The `_extra_state` objects megatron-core's layers save and load (None outside FP8): its loader wants every
    one its model has, so both specs' are written (a loader ignores what its model lacks). Stacked layers' are
    `decoder.layers.<name>._extra_state/shard_<i>_<layers>`; the rest (mixed layers, MTP modules) one object each."""
    stacked, layers, moe = homogeneous(m), m.num_layers, set(m.moe_layers()) if m.num_experts else set()
    experts = "mlp.experts.experts.linear_fc{}._extra_state/shard_{}"
    out = []
    for i in range(layers):
        key = "decoder.layers.{}._extra_state/shard_" + (f"{i}_{layers}" if stacked else "0_1")
        out += [key.format(name if stacked else f"{i}.{name}") for name in _layer_modules(m, i in moe)]
        for e in range(m.num_experts or 0) if i in moe else ():
            where = f"{i}.{e}_{layers}.{m.num_experts}" if stacked else f"{e}_{m.num_experts}"
            out += [f"decoder.layers.{'' if stacked else f'{i}.'}{experts.format(n, where)}" for n in (1, 2)]
    routed = set(m.routed_layers())
    for k in range(m.mtp_num_layers or 0):
        prefix, moe_layer = f"mtp.layers.{k}.", layers + k in routed
        names = ["eh_proj"] + [f"transformer_layer.{n}" for n in _layer_modules(m, moe_layer)]
        out += [f"{prefix}{name}._extra_state/shard_0_1" for name in names]
        out += [f"{prefix}transformer_layer.{experts.format(n, f'{e}_{m.num_experts}')}"
                for e in range(m.num_experts or 0) if moe_layer for n in (1, 2)]
    return out


def _lifted(make, lead: int):
    """The maker with `lead` leading axes of size 1 on its tensor (a layer's slice of a stacked tensor)."""
    if not lead:
        return make

    def lifted():
        t = make()
        return t.reshape((1,) * lead + tuple(t.shape))
    return lifted


def export_megatron(reader: CheckpointReader, out_dir: str, tp: int = 1, pp: int = 1, progress=None) -> str:
    """Write the checkpoint `reader` opened as a Megatron-LM torch_dist save for tp x pp in `out_dir`; return the
    iteration folder."""
    cfg = Config.from_dict(reader.meta.config)
    m = cfg.model
    check_model_split(m, tp, pp, tp_flag="--target-tp", pp_flag="--target-pp")
    args = args_from_config(cfg, tp, pp, reader.meta.extra_state)  # what Megatron-LM cannot build: refused first
    pieces = _pieces(reader, m, tp)
    it = reader.iteration
    final = os.path.join(out_dir, files.iter_dir_name(it))
    bar = progress(len(pieces)) if progress is not None else None
    with files.staged(out_dir, it) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process writes, as meant
            save({}, storage_writer=FileSystemWriter(tmp, thread_count=1, per_thread_copy_ahead=0),
                 planner=_LazyPlanner(pieces, _extra_states(m), bar), no_dist=True)
        common = {"args": args, "checkpoint_version": 3.0, "iteration": it, "num_floating_point_operations_so_far": 0,
                  "content_metadata": dict(CONTENT)}
        torch.save(common, os.path.join(tmp, COMMON_FILE))
        files.write_json_durable(os.path.join(tmp, BACKEND_FILE), BACKEND)
        files.fsync_dir(tmp)
        os.rename(tmp, final)
    files.fsync_dir(out_dir)
    files.write_text_atomic(os.path.join(out_dir, files.LATEST_FILE), f"{it}\n")
    if bar is not None:
        bar.close()
    return final

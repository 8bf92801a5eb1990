"""Megatron-LM's legacy `torch` format, seen as torch_dist sees it.

An iteration folder holds one `mp_rank_TT[_PPP]/model_optim_rng.pt` per (tensor, pipeline) rank: a pickled dict
of `args`, `iteration`, `opt_param_scheduler`, `optimizer` and `model` (`model0`, `model1`, ... per virtual
stage), whose tensors are the rank's tp slices with layers numbered from 0 on each stage. `Legacy` offers the
same `shapes` / `read(key, lead)` as torch_dist.TorchDist: layers renumbered globally and stacked, tp slices
joined (along the output rows of column-parallel linears and the embedding, along the inputs of row-parallel
ones; SwiGLU's linear_fc1 holds [gate slice; up slice] per rank, joined as [gate; up]). The local spec's norm
names are renamed to the ones torch_dist uses (its own `sharded_state_dict_keys_map`).

Files are memory-mapped (torch.load mmap), so a tensor is read when it is used. MoE, multi-latent attention and
multi-token prediction checkpoints in this format are refused in one line: Megatron-LM converts them to
torch_dist (`--ckpt-convert-format torch_dist`).
"""
from __future__ import annotations

import os
import re

import torch

from engine.checkpoint.megatron.pickled import load_file
from engine.checkpoint.megatron.tables import join_tp, tp_axis
from engine.config import ConfigError
from engine.layout import Layout

MODEL_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LOCAL_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def is_legacy(path: str) -> bool:
    return os.path.isdir(path) and any(_RANK_DIR.match(d) for d in os.listdir(path))


class Legacy:
    """One legacy iteration folder: its common state (rank 0's file minus the model) and joined tensors."""

    def __init__(self, path: str):
        self.path = path
        ranks = {}
        for d in os.listdir(path):
            match = _RANK_DIR.match(d)
            if match:
                ranks[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(path, d, MODEL_FILE)
        first = load_file(ranks[min(ranks)], "Megatron-LM's rank 0 checkpoint", mmap=True)
        args = first.get("args")
        tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
        if getattr(args, "num_experts", None) or getattr(args, "expert_model_parallel_size", 1) > 1:
            raise ConfigError(f"{path}: a mixture-of-experts checkpoint in the legacy torch format is not read; "
                              "convert it to torch_dist with Megatron-LM (--ckpt-convert-format torch_dist)")
        if getattr(args, "multi_latent_attention", False) or getattr(args, "mtp_num_layers", None):
            raise ConfigError(f"{path}: a multi-latent attention or multi-token prediction checkpoint in the legacy "
                              "torch format is not read (its down-projections are tp slices in one spec, whole in "
                              "the other); convert it to torch_dist with Megatron-LM (--ckpt-convert-format torch_dist)")
        missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
        if missing:
            t, p = missing[0]
            raise ConfigError(f"{path}: mp_rank_{t:02d}{f'_{p:03d}' if pp > 1 else ''}/ is missing (the run was "
                              f"saved at tp {tp} x pp {pp}); copy the whole iteration folder")
        self.common = {k: v for k, v in first.items() if not k.startswith("model")}
        self.tp, self.pp, self.vpp = tp, pp, getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        self.files = {key: first if key == min(ranks) else None for key in ranks}
        self._paths = ranks
        self._index(args)

    def _state(self, t: int, p: int) -> dict:
        if self.files.get((t, p)) is None:
            self.files[(t, p)] = load_file(self._paths[(t, p)], f"Megatron-LM's tp {t} pp {p} checkpoint", mmap=True)
        return self.files[(t, p)]

    def _index(self, args) -> None:
        """`where`: stored key -> [(pp rank, model key, local name, global layer)]; `shapes`: joined shapes."""
        layout = Layout(pp=self.pp, vpp=self.vpp, first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers",
                                                                             None),
                        last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None))
        self.where, self.shapes, self.dtypes = {}, {}, {}
        for p in range(self.pp):
            state = self._state(0, p)
            for v in range(self.vpp):
                model_key = "model" if self.vpp == 1 else f"model{v}"
                layers = layout.layer_ids(args.num_layers, p, v)
                for local, t in state[model_key].items():
                    if local.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                        continue
                    key, layer = self._stored_key(local, layers)
                    self.where.setdefault(key, []).append((p, model_key, local, layer))
                    shape = list(t.shape)
                    if tp_axis(key) is not None:
                        shape[tp_axis(key)] *= self.tp
                    self.shapes[key] = (args.num_layers, *shape) if layer is not None else tuple(shape)
                    self.dtypes[key] = t.dtype

    @staticmethod
    def _stored_key(local: str, layers: list) -> tuple:
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", local)
        if not match:
            return local, None
        rest = match.group(2)
        for old, new in _LOCAL_NAMES:
            rest = new + rest[len(old):] if rest.startswith(old) else rest
        return f"decoder.layers.{rest}", layers[int(match.group(1))]

    def read(self, key: str, lead: tuple = ()) -> torch.Tensor:
        """The joined tensor `key` (at layer lead[0] for a layer tensor)."""
        layer = lead[0] if lead else None
        p, model_key, local, _ = next(w for w in self.where[key] if w[3] == layer)
        parts = [self._state(t, p)[model_key][local] for t in (range(self.tp) if tp_axis(key) is not None else (0,))]
        return join_tp(key, [x.clone() for x in parts], bool(getattr(self.common["args"], "swiglu", False)))

    object_keys: list = []

    def objects(self, keys: list) -> dict:
        return {}

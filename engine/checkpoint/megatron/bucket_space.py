"""Megatron-Core's default distributed-optimizer checkpoint layout (`dp_reshardable`): state in its grad buckets.

Each (tp, pp) rank's DistributedDataParallel lays its parameters out in flat buffers (one per model chunk), in
reverse `named_parameters()` order, each parameter starting on a multiple of 64 elements, cut into buckets;
the checkpoint stores, per bucket and per state (`param`: the fp32 master, `exp_avg`, `exp_avg_sq`), the bucket's
elements up to its unpadded end, under
    optimizer.distributed.dp_group_idx_<mp rank>.gbuf_idx_<chunk>.dtype_<dtypes>.bucket_idx_<b>.<state>
(mp rank = tp rank + tp x pp rank), a tensor whose shape is that unpadded length. Nothing names the parameters,
so their places are found again here: the parameters of each stage are listed in megatron-core's module order
(`transformer_impl` decides it: the local spec has its norms as modules of their own, Transformer Engine fuses
them into the next linear, registered before its weight), and laid out as DistributedDataParallel does; a bucket
ends where the stored lengths say (bucket sizes depend on flags that are not saved). A layout that does not meet
those lengths exactly is not guessed at: the optimizer state is then left out, and said so. MoE models (a second
optimizer for the experts' buffers) and models with multi-latent attention or MTP modules (other modules, in an
order not written out here) are not laid out here.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from engine.checkpoint.megatron.tables import join_tp, tp_axis
from engine.layout import Layout

_BUCKET = re.compile(r"^(?:chained_\d+\.)?(optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+"
                     r"\.bucket_idx_(\d+))\.(param|exp_avg|exp_avg_sq)$")
_OBJECT = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_0\.(optimizer|grad_scaler)/")
STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "param"}
ALIGN = 64  # elements: where DistributedDataParallel starts each parameter under the distributed optimizer


def _layer_params(args, i: int) -> list:
    """Layer i's parameters in megatron-core's module order, by their torch_dist names."""
    attn, mlp = f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
    norm = ("weight", "bias") if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else ("weight",)
    lin = ("weight", "bias") if getattr(args, "add_bias_linear", True) else ("weight",)
    qkv = ("weight", "bias") if lin == ("weight", "bias") or getattr(args, "add_qkv_bias", False) else ("weight",)
    names = lambda prefix, kinds: [f"{prefix}{k}" for k in kinds]  # noqa: E731
    qk = names(f"{attn}q_layernorm.", norm) + names(f"{attn}k_layernorm.", norm) \
        if getattr(args, "qk_layernorm", False) else []
    if getattr(args, "transformer_impl", "transformer_engine") == "local":
        attention = names(f"{attn}linear_qkv.layer_norm_", norm) + names(f"{attn}linear_proj.", lin) + \
            names(f"{attn}linear_qkv.", qkv) + qk
    else:
        attention = names(f"{attn}linear_proj.", lin) + names(f"{attn}linear_qkv.layer_norm_", norm) + \
            names(f"{attn}linear_qkv.", qkv) + qk
    return attention + names(f"{mlp}linear_fc1.layer_norm_", norm) + names(f"{mlp}linear_fc1.", lin) + \
        names(f"{mlp}linear_fc2.", lin)


def stage_params(args, pp_rank: int, chunk: int) -> list:
    """The torch_dist names of the parameters of one model chunk of one pipeline stage, in module order."""
    pp, vpp = args.pipeline_model_parallel_size, getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    layout = Layout(pp=pp, vpp=vpp, first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
                    last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None))
    first, last = (pp_rank, chunk) == (0, 0), (pp_rank, chunk) == (pp - 1, vpp - 1)
    out = []
    if first:
        out.append("embedding.word_embeddings.weight")
        if getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute":
            out.append("embedding.position_embeddings.weight")
    for i in layout.layer_ids(args.num_layers, pp_rank, chunk):
        out += _layer_params(args, i)
    if last:
        norm = ("weight", "bias") if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else ("weight",)
        out += [f"decoder.final_layernorm.{k}" for k in norm]
        if getattr(args, "untie_embeddings_and_output_weights", False) or pp > 1:
            out.append("output_layer.weight")  # tied at pp > 1: the last stage's copy, a bucket of its own
    return out


def lay_out(numels: list, sizes: list) -> Optional[list]:
    """(bucket, offset in it) of each parameter (numels in module order) in buckets of unpadded `sizes`, laid out
    as DistributedDataParallel does (reverse order, starts on multiples of ALIGN); None if they do not fit."""
    places, b, at = [None] * len(numels), 0, 0
    for n in reversed(range(len(numels))):
        at = -(-at // ALIGN) * ALIGN
        if at and b < len(sizes) and at == sizes[b]:  # a bucket closed before this parameter (the tied embedding)
            b, at = b + 1, 0
        if b >= len(sizes):
            return None
        places[n] = (b, at)
        at += numels[n]
        if at == sizes[b]:
            b, at = b + 1, 0
    return places if (b, at) == (len(sizes), 0) else None


class BucketSpace:
    def __init__(self, ck):
        self.ck, self.index, self.why_not = ck, {}, None
        self.inner, self.scaler = [], None

    @classmethod
    def open(cls, ck, model_entries: dict) -> "BucketSpace":
        self = cls(ck)
        objects = ck.tensors.objects([k for k in ck.tensors.object_keys if _OBJECT.match(k)])
        for key, value in objects.items():
            value = value[0] if isinstance(value, list) and len(value) == 1 else value  # megatron-core packs [data]
            if _OBJECT.match(key).group(1) == "optimizer":
                self.inner.append(value)
            else:
                self.scaler = value
        if getattr(ck.args, "num_experts", None) or getattr(ck.args, "multi_latent_attention", False) or \
                getattr(ck.args, "mtp_num_layers", None):
            self.why_not = "its optimizer state is in Megatron's bucket layout (dp_reshardable), which is read for " \
                           "dense models without multi-latent attention or MTP only; save it with " \
                           "--dist-ckpt-optim-fully-reshardable"
            return self
        self.why_not = self._index()
        return self

    def _buckets(self) -> dict:
        """(mp rank, chunk) -> [(stored key prefix, unpadded length)] by bucket."""
        found = {}
        for key, shape in self.ck.tensors.shapes.items():
            match = _BUCKET.match(key)
            if match and match.group(5) == "param":
                r, g, b = int(match.group(2)), int(match.group(3)), int(match.group(4))
                found.setdefault((r, g), {})[b] = (key[: -len(".param")], shape[0])
        return {k: [v[b] for b in sorted(v)] for k, v in found.items()}

    def _index(self) -> Optional[str]:
        args, buckets = self.ck.args, self._buckets()
        tp = args.tensor_model_parallel_size
        for (r, chunk), stored in sorted(buckets.items()):
            t, p = r % tp, r // tp
            wheres = [self.ck.locate((name,)) or (name, ()) for name in stage_params(args, p, chunk)]
            shapes = [self._local_shape(w, tp) for w in wheres]
            places = lay_out([torch.Size(s).numel() for s in shapes], [n for _, n in stored])
            if places is None:
                return (f"its optimizer state (Megatron's bucket layout, dp_reshardable) does not match megatron-core "
                        f"0.16's parameter layout for tp rank {t}, pp rank {p} (transformer_impl "
                        f"{getattr(args, 'transformer_impl', None)!r}); save it with "
                        "--dist-ckpt-optim-fully-reshardable")
            for where, shape, (b, offset) in zip(wheres, shapes, places):
                self.index.setdefault(where, [None] * tp)[t] = (stored[b][0], offset, shape)
        missing = [w for w, parts in self.index.items() if None in parts]
        return f"its bucket-layout optimizer state lacks tp ranks of {missing[0][0]}" if missing else None

    def _local_shape(self, where: tuple, tp: int) -> tuple:
        key, lead = where
        shapes = self.ck.tensors.shapes
        shape = list(shapes.get(key, shapes["embedding.word_embeddings.weight"])[len(lead):])
        axis = tp_axis(key)
        if axis is not None:
            shape[axis] //= tp
        return tuple(shape)

    def keys_for(self, where: tuple) -> Optional[dict]:
        return {ours: (where, theirs) for ours, theirs in STATE.items()} if where in self.index else None

    def read(self, located: tuple) -> torch.Tensor:
        where, state = located
        parts = []
        for prefix, offset, shape in self.index[where]:
            flat = self.ck.tensors.read_region(f"{prefix}.{state}", (offset,), (torch.Size(shape).numel(),))
            parts.append(flat.view(shape).to(torch.float32))
        return join_tp(where[0], parts, bool(getattr(self.ck.args, "swiglu", False)))

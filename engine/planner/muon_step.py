"""Muon's step as the planner prices it (--optimizer muon; engine/optim/muon_plan.py is what it counts): the
Newton-Schulz FLOPs one rank runs and the bytes it sends to bring its matrices whole and their updates back.

Per layer, the matrices Muon orthogonalises (engine/optim/newton_schulz.py): the fused QKV as q, k and v (one
matrix with --muon-no-split-qkv), the output projection, fc1 ([gate; up] as one matrix), fc2, a shared expert's
two, and the E/ep routed experts' two each; the embedding and the output layer are AdamW's. A tp-split matrix is
orthogonalised whole (duplicated, distributed) or as each rank's shard (blockwise); a step of Newton-Schulz on
an m x n matrix (m <= n) costs 4 m^2 n + 2 m^3 FLOPs.

Under the distributed optimizer a matrix has one owner among its n replicas (dp x cp; dp/ep x cp for experts),
dealt by FLOPs, so a rank runs 1/n of the work, and under distributed 1/tp of that; without sharding every
replica runs all of it. Bytes (fp32), for P elements of Muon's weights on a tp rank: the replica exchange sends
each element its owner does not hold there and back, 8 P (n - 1) / n^2 per rank when the weights spread evenly
over the replicas' slices (what the engine sends when its buckets cut them in parts of similar size, as
tests/test_muon.py measures; less where a weight lies within one slice, as small weights in large buckets may,
since each goes to the replica holding most of it where the FLOPs balance allows); duplicated all-gathers each
owned shard over tp, 4 (tp - 1) P / n; distributed sends the shards to the owning tp rank and the slices back,
8 (tp - 1) / tp x P / n.
"""
from __future__ import annotations

from typing import NamedTuple

from engine.config import ModelConfig
from engine.flops import attention_matrices, attention_splits, mlp_matrices
from engine.layout import Layout
from engine.optim.newton_schulz import MuonSettings, newton_schulz_flops
from engine.planner.stages import moe_layers_per_rank, stage_layer_counts

FP32 = 4


class MuonCost(NamedTuple):
    """One pipeline rank's Muon step: per rank of it (the busiest replica, tp rank)."""
    flops: float      # Newton-Schulz FLOPs
    dp_bytes: float   # sent over the dense weights' replicas (dp x cp)
    edp_bytes: float  # sent over the experts' replicas (dp/ep x cp)
    tp_bytes: float   # sent over tp


def _dense_matrices(model: ModelConfig, settings: MuonSettings, moe: bool) -> list:
    """(rows, columns, split axis) of a layer's tensor-parallel matrices, whole: column-parallel ones split
    their rows over tp (axis 0), row-parallel ones their columns (axis 1)."""
    ffn = model.moe_shared_expert_intermediate_size if moe else model.resolved_ffn_hidden_size()
    mlp = [(*m, axis) for m, axis in zip(mlp_matrices(model, ffn), (0, 1))] if ffn else []
    if model.multi_latent_attention:  # each projection a matrix (the replicated ones whole on every rank)
        return [(*m, axis) for m, axis in zip(attention_matrices(model), attention_splits(model))] + mlp
    (qkv_rows, h), proj = attention_matrices(model)
    d, nq, nkv = model.head_dim(), model.num_attention_heads, model.resolved_query_groups()
    qkv = [(nq * d, h, 0), (nkv * d, h, 0), (nkv * d, h, 0)] if settings.split_qkv else [(qkv_rows, h, 0)]
    return qkv + [(*proj, 1)] + mlp


def _flops(matrices: list, tp: int, settings: MuonSettings) -> float:
    """Newton-Schulz FLOPs of these matrices on one rank that orthogonalises all of them: whole, or its shards."""
    steps, out = len(settings.coefficients), 0
    for rows, cols, axis in matrices:
        if not settings.whole_over_tp:
            rows, cols = (rows // tp, cols) if axis == 0 else (rows, cols // tp) if axis == 1 else (rows, cols)
        out += newton_schulz_flops(rows, cols, steps)
    return out


def muon_cost(model: ModelConfig, layout: Layout, rank: int, settings: MuonSettings) -> MuonCost:
    """The Muon step of pipeline rank `rank` (module docstring)."""
    tp, sharded = layout.tp, layout.sharding.optimizer
    n, ne = (layout.shard_group, layout.expert_shard_group) if sharded else (1, 1)
    n_moe = moe_layers_per_rank(model, layout)[rank] if model.num_experts else 0
    dense_layers = sum(stage_layer_counts(model.num_layers, layout)[rank]) - n_moe
    dense = [m for _ in range(dense_layers) for m in _dense_matrices(model, settings, False)]
    dense += [m for _ in range(n_moe) for m in _dense_matrices(model, settings, True)]
    experts = [(rows, cols, None) for _ in range(n_moe * model.num_experts // layout.ep)
               for rows, cols in mlp_matrices(model, model.resolved_moe_ffn_hidden_size())] if n_moe else []
    spread = tp if settings.spread_over_tp and tp > 1 else 1
    flops = _flops(dense, tp, settings) / (n * spread) + _flops(experts, 1, settings) / ne  # experts: whole
    p_dense = sum(rows * cols for rows, cols, _ in dense) / tp
    p_experts = sum(rows * cols for rows, cols, _ in experts)
    tp_bytes = 0.0
    if settings.whole_over_tp and tp > 1:
        tp_bytes = FP32 * p_dense / n * (tp - 1) * (2 / tp if settings.spread_over_tp else 1)
    return MuonCost(flops, 2 * FP32 * p_dense * (n - 1) / n ** 2, 2 * FP32 * p_experts * (ne - 1) / ne ** 2, tp_bytes)

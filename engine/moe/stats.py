"""What the MoE layers did in a step, summed over the job, and the aux-loss-free expert-bias update.

Every MoE layer adds, per microbatch, the tokens routed to each expert in the whole microbatch (already
summed over the ranks holding its tokens), its balancing and z-loss values and the assignments dropped
over capacity. `MoEStats.finish_step()` (called by the step, engine.stepping, once the gradients are
reduced, every rank, every step: it is one all-reduce over the world) sums them over data-parallel replicas and pipeline
stages, then
- moves each expert bias by rate x sign(mean load - load) (DeepSeek-V3's aux-loss-free balancing; the same
  update on every rank, so the replicated biases stay equal), and
- returns the step's metrics: `moe_aux_loss` and `moe_z_loss` (means over MoE layers and microbatches),
  `moe_max_load` (the busiest expert's tokens over the mean, the worst layer), `moe_dropped` (assignments
  dropped in the step), and where the expert-parallel group spans nodes `moe_node_tokens` (the assignments each
  node's experts received, over the layers: what group-limited routing bounds).
"""
from __future__ import annotations

import os

import torch

from engine.moe.layer import MoELayer
from engine.parallel import comm


def moe_blocks(model_chunks: list) -> list:
    """(global layer id, MoELayer) of this rank's MoE layers, the MTP modules' included."""
    return [(m.layer_id, m) for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def expert_nodes(cfg, ctx):
    """The node (0, 1, ...) of each expert's EP rank, or None when the EP group lies within one node
    (--gpus-per-node, else torchrun's LOCAL_WORLD_SIZE)."""
    per_node = cfg.parallel.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    first = {}
    nodes = [first.setdefault(rank // per_node, len(first)) for rank in ctx.ep_ranks]
    if len(first) < 2:
        return None
    per_rank = cfg.model.num_experts // len(nodes)
    return [nodes[e // per_rank] for e in range(cfg.model.num_experts)]


class MoEStats:
    def __init__(self, cfg, model_chunks: list, ctx, device):
        self.ctx, self.device, self.m = ctx, device, cfg.model
        self.ids = cfg.model.routed_layers()
        self.row = {layer_id: i for i, layer_id in enumerate(self.ids)}
        self.blocks = moe_blocks(model_chunks)
        self.nodes = expert_nodes(cfg, ctx)

    def finish_step(self) -> dict:
        if not self.ids:
            return {}
        E, ctx = self.m.num_experts, self.ctx
        table = torch.zeros(len(self.ids), E + 4, dtype=torch.float64, device=self.device)
        # Counts are already whole-microbatch sums on every rank holding its tokens: one of them adds them.
        contributes = ctx.token_group_rank == 0
        for layer_id, block in self.blocks:
            st = block.stats
            if contributes:
                table[self.row[layer_id], :E] = st.counts.to(self.device)
                table[self.row[layer_id], E:] = torch.tensor(st.totals(), dtype=torch.float64)
            block.reset_stats()
        if ctx.world_size > 1:
            comm.all_reduce(table)
        counts, aux, z, dropped, microbatches = table[:, :E], table[:, E], table[:, E + 1], table[:, E + 2], \
            table[:, E + 3].clamp(min=1)
        if self.m.moe_router_enable_expert_bias:
            self._update_biases(counts)
        load = counts.max(1).values / counts.mean(1).clamp(min=1e-9)
        out = {"moe_aux_loss": float((aux / microbatches).mean()), "moe_z_loss": float((z / microbatches).mean()),
               "moe_max_load": float(load.max()), "moe_dropped": int(dropped.sum())}
        if self.nodes is not None:  # the EP group spans nodes: what each node's experts received
            per_node = torch.zeros(max(self.nodes) + 1, dtype=torch.float64).index_add_(
                0, torch.tensor(self.nodes), counts.sum(0).cpu())
            out["moe_node_tokens"] = [int(n) for n in per_node]
        return out

    @torch.no_grad()
    def _update_biases(self, counts: torch.Tensor) -> None:
        rate = self.m.moe_router_bias_update_rate
        for layer_id, block in self.blocks:
            c = counts[self.row[layer_id]]
            bias = block.router.expert_bias
            bias += (rate * torch.sign(c.mean() - c)).to(bias.dtype).to(bias.device)

"""Routing tokens to experts: a pure function of the tokens and the weights, the same on every layout.

The router computes fp32 logits [T, E] for this rank's tokens and picks each token's top-k experts:
- softmax: scores = softmax(logits); weights = the chosen scores renormalised over the top k (the same as
  a softmax over the top-k logits: Mixtral, Megatron-LM's default);
- sigmoid: scores = sigmoid(logits); weights = the chosen scores over their sum when k > 1 (DeepSeek-V3).
Group-limited routing (--moe-router-num-groups G, --moe-router-group-topk M; DeepSeek-V3's node-limited routing)
picks each token's experts among M of the G equal groups of consecutive expert ids only, the groups ranked by
the sum of their two best choice scores (as DeepSeek-V3's code and transformers rank them; Megatron-Core sums
the top k/M, the same at V3's k = 8, M = 4), so its all-to-all reaches at most M groups (nodes, when each
node's experts make one group).
An expert bias (aux-loss-free balancing, `--moe-router-enable-expert-bias`) is added to the scores for the
choice only, never to the weights; `engine.moe.stats` moves it towards balance after every step.

Everything a decision needs about the whole microbatch is summed over the ranks holding its tokens (tp
under sequence parallelism, then cp), so tp, cp and ep never change what a token is routed to:
- the load-balancing loss (Switch/GShard form, as Megatron-LM: coeff x E / (T^2 k) x sum_e P_e c_e, with
  P_e the summed scores and c_e the tokens routed to e, over the microbatch, or per sequence for
  seq_aux_loss) and the z-loss (coeff x mean logsumexp(logits)^2). Each rank's part uses its own scores
  and the summed counts, so the parts add up to the loss and its gradient;
- the capacity of each expert (ceil(factor x T x k / E) over the microbatch's T tokens) and which
  assignments over it are dropped: the lowest weights (probs; weights compared on a 1/1024 grid, so that
  fp32 rounding differences between layouts almost never reorder them) or the latest tokens in the
  microbatch, samples first (position), ties by that order; decided from the gathered assignments of all
  its ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import comm
from engine.parallel.layers import make_param


WEIGHT_GRID = 1024  # capacity's "probs" policy ranks weights rounded to multiples of 1/WEIGHT_GRID


@dataclass
class Routing:
    """One microbatch's routing on this rank: T tokens, k choices each."""
    experts: torch.Tensor       # [T, k] global expert ids
    weights: torch.Tensor       # [T, k] fp32 combine weights (differentiable), 0 where dropped
    kept: torch.Tensor          # [T, k] bool: the assignment was not dropped over capacity
    aux_loss: Optional[torch.Tensor]  # this rank's part of the balancing + z losses (differentiable) or None
    counts: torch.Tensor        # [E] tokens routed to each expert in the whole microbatch (before dropping)
    aux_value: float            # the whole microbatch's balancing loss (logged)
    z_value: float              # the whole microbatch's z-loss (logged)
    dropped: int                # assignments dropped over capacity in the whole microbatch


def token_group_sum(t: torch.Tensor, ctx) -> torch.Tensor:
    """Sum over the ranks holding the microbatch's tokens (ctx.token_group: tp under SP, times cp); in place."""
    if ctx.token_group_size > 1:
        comm.all_reduce(t, ctx.token_group)
    return t


def _token_group_gather(t: torch.Tensor, ctx) -> torch.Tensor:
    """This microbatch's rows from every rank holding its tokens, in token-group order (equal sizes)."""
    if ctx.token_group_size == 1:
        return t
    out = t.new_empty((ctx.token_group_size * t.shape[0],) + tuple(t.shape[1:]))
    comm.all_gather_into(out, t, group=ctx.token_group)
    return out


class Router(nn.Module):
    def __init__(self, cfg, ctx, device=None, dtype=None):
        super().__init__()
        self.ctx, self.cfg, self.num_experts = ctx, cfg, cfg.num_experts
        # Replicated; under SP each tp rank's gradient covers its own tokens only (summed over tp).
        self.weight = make_param((cfg.num_experts, cfg.hidden_size), None, ctx, ("normal", cfg.init_method_std),
                                 device, dtype, sp_partial_grad=True)
        if cfg.moe_router_enable_expert_bias:
            self.expert_bias = make_param((cfg.num_experts,), None, ctx, ("zeros",), device, torch.float32)
            self.expert_bias.requires_grad_(False)  # moved by engine.moe.stats, not by the optimizer
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor, token_keys: torch.Tensor, seq_shape: tuple) -> Routing:
        """x [T, h] this rank's tokens; token_keys [T, 2] their (sample, position) in the microbatch;
        seq_shape (s_local, b): x is [s_local, b] flattened."""
        cfg, k = self.cfg, self.cfg.moe_router_topk
        dtype = torch.float64 if cfg.moe_router_dtype == "fp64" else torch.float32
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        scores = logits.softmax(-1) if cfg.moe_router_score_function == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.to(dtype)
        experts = self._within_groups(choice.detach()).topk(k, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.moe_router_score_function == "softmax" or k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        if cfg.moe_router_topk_scaling_factor:
            weights = weights * cfg.moe_router_topk_scaling_factor
        counts_local = torch.zeros(self.num_experts, dtype=dtype, device=x.device)
        counts_local.index_add_(0, experts.reshape(-1), torch.ones(experts.numel(), dtype=dtype, device=x.device))
        aux, aux_value, z_value, counts = self._losses(logits, scores, experts, counts_local, seq_shape)
        kept, dropped = self._capacity(experts, weights.detach(), token_keys, counts)
        return Routing(experts, weights.float() * kept, kept, aux, counts, aux_value, z_value, dropped)

    def _within_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores [T, E] with -inf outside each token's --moe-router-group-topk best groups (unchanged
        without --moe-router-num-groups)."""
        groups = self.cfg.moe_router_num_groups
        if not groups:
            return choice
        per_group = choice.view(choice.shape[0], groups, -1)
        ranked = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)  # [T, groups]
        best = ranked.topk(self.cfg.moe_router_group_topk, dim=-1).indices
        keep = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, best, True)
        return per_group.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    # ------------------------------------------------------------------ balancing and z losses
    def _losses(self, logits, scores, experts, counts_local, seq_shape) -> tuple:
        cfg, ctx, E, k = self.cfg, self.ctx, self.num_experts, self.cfg.moe_router_topk
        kind, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        T_local = logits.shape[0]
        probs = scores if cfg.moe_router_score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
        lse = torch.logsumexp(logits, dim=-1)
        # One collective for the counts, the summed probabilities and the z-loss sum (and per sequence).
        parts = [counts_local, probs.detach().sum(0), lse.detach().square().sum().reshape(1)]
        per_seq = kind == "seq_aux_loss" and coeff > 0
        if per_seq:
            s_local, b = seq_shape
            one_hot = torch.zeros_like(probs).scatter_(1, experts, 1.0)
            parts += [one_hot.view(s_local, b, E).sum(0).reshape(-1), probs.detach().view(s_local, b, E).sum(0).reshape(-1)]
        summed = token_group_sum(torch.cat(parts), ctx)
        counts, probs_sum, z_sum = summed[:E], summed[E:2 * E], summed[2 * E]
        T = T_local * ctx.token_group_size
        aux, aux_value = None, 0.0
        if kind == "aux_loss" and coeff > 0:
            scale = coeff * E / (T * T * k)
            aux = scale * (probs.sum(0) * counts).sum()
            aux_value = float(scale * (probs_sum * counts).sum())
        elif per_seq:
            s_local, b = seq_shape
            s = T // b
            seq_counts = summed[2 * E + 1:2 * E + 1 + b * E].view(b, E)
            seq_probs = summed[2 * E + 1 + b * E:].view(b, E)
            scale = coeff * E / (s * s * k * b)
            aux = scale * (probs.view(s_local, b, E).sum(0) * seq_counts).sum()
            aux_value = float(scale * (seq_probs * seq_counts).sum())
        z_value = 0.0
        if cfg.moe_z_loss_coeff:
            z = cfg.moe_z_loss_coeff * lse.square().sum() / T
            aux = z if aux is None else aux + z
            z_value = float(cfg.moe_z_loss_coeff * z_sum / T)
        return aux, aux_value, z_value, counts

    # ------------------------------------------------------------------ capacity
    def _capacity(self, experts, weights, token_keys, counts) -> tuple:
        """(kept [T, k] bool, assignments dropped in the microbatch): the same decision on every layout."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.moe_expert_capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool), 0
        T_local, k = experts.shape
        T = T_local * ctx.token_group_size
        capacity = math.ceil(cfg.moe_expert_capacity_factor * T * k / self.num_experts)
        if int(counts.max()) <= capacity:
            return torch.ones_like(experts, dtype=torch.bool), 0
        keys = token_keys[:, None, :].expand(T_local, k, 2).to(weights.dtype)
        mine = torch.cat((experts.to(weights.dtype)[..., None], weights[..., None], keys), dim=-1).reshape(-1, 4)
        every = _token_group_gather(mine, ctx)  # [T * k, 4]: this rank's rows are one contiguous block
        kept = _keep_within_capacity(every, capacity, cfg.moe_token_drop_policy)
        block = ctx.token_group_rank * T_local * k
        return kept[block:block + T_local * k].view(T_local, k), int((~kept).sum())


def _keep_within_capacity(rows: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    """rows [N, 4] of (expert, weight, sample, position): which assignments are within their expert's capacity."""
    expert, weight, sample, position = rows[:, 0].long(), rows[:, 1], rows[:, 2], rows[:, 3]
    order = torch.argsort(position, stable=True)
    order = order[torch.argsort(sample[order], stable=True)]  # the earliest token first among equals
    if policy == "probs":
        # The heaviest first, weights compared on a 2^-10 grid: layouts differ in fp32 rounding (~1e-7), and
        # on the grid only a weight within that of a grid line can rank differently (then by position).
        coarse = torch.round(weight * WEIGHT_GRID)
        order = order[torch.argsort(-coarse[order], stable=True)]
    order = order[torch.argsort(expert[order], stable=True)]  # grouped by expert
    sorted_expert = expert[order]
    start = torch.searchsorted(sorted_expert, sorted_expert, right=False)
    rank_in_expert = torch.arange(rows.shape[0], device=rows.device) - start
    kept = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
    kept[order] = rank_in_expert < capacity
    return kept

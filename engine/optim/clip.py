"""The global gradient L2 norm over tp, pp and dp, each parameter element counted exactly once.

A rank sums the squares of the gradient pieces it is responsible for, then the sums are added over
the groups that hold different pieces:
- tp: TP-sharded parameters (a `tp_axis` in their ParamSpec) hold different slices on every TP rank and
  are summed; parameters replicated over TP hold the same gradient on every TP rank and count on TP
  rank 0 only.
- pp: stages hold different layers and are summed; the last stage's copy of the embedding tied across
  stages (`copy_of` in its spec) does not count, the first stage's original does.
- dp (with cp: the dp x cp replicas): replicas hold the same reduced gradients, except under the
  distributed optimizer, where each holds its own shard and the shards are summed;
- MoE experts: EP ranks hold different experts (summed over ep); their replicas are the dp/ep x cp ranks.
"""
from __future__ import annotations

import math

import torch

from engine.parallel import comm
from engine.parallel.layers import spec_of


def counts_toward_norm(p, ctx) -> bool:
    spec = spec_of(p)
    return spec.copy_of is None and (spec.tp_axis is not None or ctx.tp_rank == 0)


NORM_BLOCK = 1 << 16  # elements whose norm one reduction takes: see _square


def _square(g: torch.Tensor) -> torch.Tensor:
    """‖g‖² in fp32, to fp32 rounding at any size. torch's CPU vector_norm adds a whole tensor into one running
    fp32 sum: 4M elements come out 1e-4 off (the first H100 run found the CPU step's grad norm 1e-5 from the
    GPU's, whose tree reduction was right). So the norm is taken per block of NORM_BLOCK elements (one view, one
    reduction) and the blocks' squares summed pairwise, on every device alike."""
    flat = g.reshape(-1)
    whole = flat.numel() - flat.numel() % NORM_BLOCK
    parts = []
    if whole:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_BLOCK), dim=1, dtype=torch.float32)
        parts.append(rows.square().sum())
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).square())
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _square_sum(grads: list, device) -> torch.Tensor:
    if grads:
        return torch.stack([_square(g) for g in grads]).sum()
    return torch.zeros((), dtype=torch.float32, device=device)


def global_grad_norm(grads: list, ctx, *, sharded_over_dp: bool, device, expert_grads=None) -> float:
    """L2 norm of the whole model's gradient; `grads` are this rank's counted pieces (inf/nan propagate).

    `expert_grads`: the counted pieces of MoE experts (None: the model has none on this stage). Each EP
    rank holds other experts, so their squares are summed over the EP group, and over the experts'
    replicas when sharded, before joining the rest."""
    sq = _square_sum(grads, device)
    if sharded_over_dp and ctx.dp_cp_size > 1:
        comm.all_reduce(sq, group=ctx.dp_cp_group)
    if expert_grads is not None:
        esq = _square_sum(expert_grads, device)
        if ctx.ep_size > 1:
            comm.all_reduce(esq, group=ctx.ep_group)
        if sharded_over_dp and ctx.edp_cp_size > 1:
            comm.all_reduce(esq, group=ctx.edp_cp_group)
        sq = sq + esq
    mp_group = getattr(ctx, "mp_group", None)
    if mp_group is not None:
        groups = [(mp_group, ctx.tp_size * ctx.pp_size)]
    else:
        groups = [(ctx.tp_group, ctx.tp_size), (ctx.pp_group, ctx.pp_size)]
    for group, size in groups:
        if size > 1:
            comm.all_reduce(sq, group=group)
    return math.sqrt(sq.item())


def norm_share(grads: list, ctx, *, sharded_over_dp: bool, device, expert_grads=None) -> torch.Tensor:
    """This rank's share of the squared global norm, such that the sum over every rank is the square of
    `global_grad_norm`: the same pieces, replicas counted on their first rank only (the dp x cp rank 0 for
    dense gradients, the experts' replica rank 0 for theirs) unless sharded over them. One all-reduce over
    all ranks then gives the norm, which post-validation starts without waiting (engine.optim.post_validation)."""
    sq = _square_sum(grads, device) if sharded_over_dp or ctx.dp_cp_rank == 0 else torch.zeros((), device=device)
    if expert_grads is not None and (sharded_over_dp or ctx.edp_cp_rank == 0):
        sq = sq + _square_sum(expert_grads, device)
    return sq


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Megatron's rule: scale by max_norm / (norm + 1e-6) when that is below 1; `max_norm` 0 disables."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))

"""Moving tokens to their experts and back: permute, all-to-all over the EP group, unpermute, combine.

Assignments (token, expert) are sorted by expert (a stable argsort: no Python loop over tokens) and the
tokens gathered in that order. With expert parallelism each rank learns every EP rank's counts per expert
(one all-gather of [E] counts), sends each rank the run of its experts with one `all_to_all_single`
(uneven splits), regroups what it received from source-major to expert-major for the grouped GEMM, and
sends the results back the same way. The combine is a weighted index_add into the tokens' rows. The
all-to-all is an autograd Function whose backward is the all-to-all with the splits swapped.
"""
from __future__ import annotations

import torch

from engine.parallel import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list, in_splits: list, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def dispatch_combine(x: torch.Tensor, routing, experts, ctx) -> torch.Tensor:
    """sum_k weight_k * expert_k(x) for every token of x [T, h] (dropped assignments contribute nothing)."""
    T, k = routing.experts.shape
    E = experts.local * ctx.ep_size
    token = torch.arange(T, device=x.device).repeat_interleave(k)
    expert = routing.experts.reshape(-1)
    keep = routing.kept.reshape(-1)
    token, expert, weight = token[keep], expert[keep], routing.weights.reshape(-1)[keep]
    order = torch.argsort(expert, stable=True)
    inputs = x.index_select(0, token[order])
    counts = torch.bincount(expert, minlength=E)
    if ctx.ep_size == 1:
        out = experts(inputs, counts.tolist())
    else:
        out = _through_ep(inputs, counts, experts, ctx)
    out = out.index_select(0, _inverse(order))
    combined = torch.zeros_like(x).index_add(0, token, out * weight.to(out.dtype)[:, None])
    return combined


def _through_ep(inputs: torch.Tensor, counts: torch.Tensor, experts, ctx) -> torch.Tensor:
    """Send each EP rank the tokens for its experts, run ours, send the results back (same order)."""
    ep, local, me = ctx.ep_size, experts.local, ctx.ep_rank
    every = torch.empty((ep, counts.numel()), dtype=counts.dtype, device=counts.device)
    comm.all_gather_into(every.view(-1), counts, group=ctx.ep_group)
    every = every.view(ep, ep, local)  # [source rank, destination rank, local expert]
    in_splits = every[me].sum(-1).tolist()           # what this rank sends to each rank
    out_splits = every[:, me].sum(-1).tolist()       # what each rank sends to this one
    received = _AllToAll.apply(inputs, out_splits, in_splits, ctx.ep_group)
    # Received rows are source-major (then expert); the GEMM wants them expert-major (then source).
    mine = every[:, me]                              # [source, local expert] counts
    key = (torch.arange(local, device=counts.device)[None, :] * ep + torch.arange(ep, device=counts.device)[:, None])
    row_key = torch.repeat_interleave(key.reshape(-1), mine.reshape(-1))
    regroup = torch.argsort(row_key, stable=True)
    out = experts(received.index_select(0, regroup), mine.sum(0).tolist())
    out = out.index_select(0, _inverse(regroup))
    return _AllToAll.apply(out, in_splits, out_splits, ctx.ep_group)

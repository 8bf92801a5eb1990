"""The MoE block that replaces a layer's MLP: router, routed experts, optional shared expert.

`MoELayer(x)` takes and gives [s, b, h] (this rank's tokens: under sequence parallelism each tp rank
routes its own slice, under context parallelism its positions) and adds the routed experts' weighted
outputs to the shared expert's. The balancing and z losses join backward through `_AuxLossGradient`:
forward returns the activations unchanged, backward adds d(aux)/d(router) scaled like the LM loss (1 /
microbatches x the fp16 loss scale: the layer's `aux_loss_scale`, which its model's `set_aux_loss_scale`
sets for each step the pipeline runner runs; 1 for a model called directly), so the logged LM loss is
untouched. Each training forward with gradients (once per microbatch, the replay of a recomputed layer
included, its first no-grad pass not) adds its routing statistics for engine.moe.stats.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.moe.token_dispatch import dispatch_combine
from engine.moe.experts import Experts
from engine.moe.router import Router

@dataclass
class RoutingStats:
    """What an MoE layer routed since the step began, for engine.moe.stats: per expert, the whole microbatches'
    token counts; the balancing and z losses and the assignments dropped, summed over microbatches."""
    counts: torch.Tensor  # [E] float64
    aux: float = 0.0
    z: float = 0.0
    dropped: int = 0
    microbatches: int = 0

    def add(self, routing) -> None:
        self.counts += routing.counts.detach().to(torch.float64).cpu()
        self.aux += routing.aux_value
        self.z += routing.z_value
        self.dropped += routing.dropped
        self.microbatches += 1

    def totals(self) -> list:
        return [self.aux, self.z, self.dropped, self.microbatches]


class _AuxLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def with_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """`out` unchanged, with `aux` joining backward with the gradient `scale`, the LM loss's 1/microbatches x
    loss scale (the MoE losses, MTP's)."""
    return _AuxLossGradient.apply(out, aux, scale)


class MoELayer(nn.Module):
    def __init__(self, cfg, ctx, out_std: float, device=None, dtype=None, shared=None, layer_id: int = 0):
        """`shared`: the shared expert (a tensor-parallel MLP module), or None; `layer_id`: its layer's global id."""
        super().__init__()
        self.ctx, self.cfg, self.layer_id = ctx, cfg, layer_id
        self.router = Router(cfg, ctx, device, dtype)
        self.experts = Experts(cfg, ctx, out_std, device, dtype)
        self.shared = shared
        self.aux_loss_scale = 1.0  # the balancing losses' gradient scale: 1 until its model sets the step's
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = RoutingStats(torch.zeros(self.cfg.num_experts, dtype=torch.float64))

    def _token_keys(self, positions: torch.Tensor, b: int) -> torch.Tensor:
        """[s_local * b, 2]: each local token's (sample, position) in the microbatch, s-major like x; `positions`
        those of this rank's part of the sequence (its sequence-parallel slice is taken here)."""
        mine = self.ctx.local_seq(positions)
        samples = torch.arange(b, device=positions.device)
        return torch.stack((samples.repeat(mine.shape[0]), mine.repeat_interleave(b)), dim=1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s_local, b, h = x.shape
        tokens = x.reshape(-1, h)
        routing = self.router(tokens, self._token_keys(positions, b), (s_local, b))
        out = dispatch_combine(tokens, routing, self.experts, self.ctx)
        if routing.aux_loss is not None and torch.is_grad_enabled():
            out = with_aux_loss(out, routing.aux_loss, self.aux_loss_scale)
        if self.training and torch.is_grad_enabled():
            self.stats.add(routing)
        out = out.view(s_local, b, h)
        return out if self.shared is None else out + self.shared(x)

"""Pick the fastest AdamW at run time and give uniform access to its per-tensor state.

CUDA tensors: apex's FusedAdam when it imports and its CUDA extension is built, else PyTorch's fused
AdamW. Other devices: `ForeachAdamW` below, PyTorch's foreach AdamW arithmetic written out. State is
created eagerly (zero moments, step 0) so that its size can be measured and a checkpoint loaded before
the first step.

Why a written-out AdamW off CUDA: constructing any `torch.optim` optimizer imports `torch._dynamo`
(`Optimizer.__init__` is wrapped by `torch._disable_dynamo`): 2.8 s of CPU per process on the 2-core
development machine, where torch itself imports in 2.3 s. Measured there: the checkpoint and MoE resume
tests (seven CPU jobs, 39 ranks) took 99 s instead of 118 s. The arithmetic is PyTorch's `_multi_tensor_adam` with decoupled weight decay, op
for op, so results are bitwise those of `torch.optim.AdamW(foreach=True)` (tests/test_optim_single.py).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def make_adamw(groups: list, *, lr: float, betas: tuple, eps: float, device: torch.device):
    """`groups`: param-group dicts with `params` and `weight_decay` (decoupled, AdamW style)."""
    if device.type == "cuda":
        apex_adam = _apex_fused_adam()
        if apex_adam is not None:
            try:
                opt = apex_adam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
                _init_state(opt)
                return opt
            except RuntimeError:  # imported without its CUDA extension
                pass
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    else:
        opt = ForeachAdamW(groups, lr=lr, betas=betas, eps=eps)
    _init_state(opt)
    return opt


class ForeachAdamW:
    """AdamW (decoupled weight decay, no amsgrad) over each group's tensors with `torch._foreach_*` ops.

    The same interface as far as this package uses it: `param_groups` (dicts with `params`, `lr`, `betas`,
    `eps`, `weight_decay`), `state[p]` with `exp_avg`, `exp_avg_sq` and `step` (a float32 CPU scalar
    tensor, as PyTorch keeps it) and `step()`. Parameters without a gradient are left alone, step count
    included."""

    def __init__(self, groups: list, *, lr: float, betas: tuple, eps: float):
        self.param_groups = [dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0) | g | {"params": list(g["params"])}
                             for g in groups]
        self.state = defaultdict(dict)  # keyed by tensor identity, as torch.optim's

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(params, [self.state[p] for p in params], group)

    @staticmethod
    def _update(params: list, states: list, group: dict) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        if decay != 0:
            torch._foreach_mul_(params, 1 - lr * decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [s.item() for s in steps]
        step_size = [(lr / (1 - beta1 ** n)) * -1 for n in counts]
        correction2_sqrt = [(1 - beta2 ** n) ** 0.5 for n in counts]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _is_torch(opt) -> bool:
    """Whether the optimizer keeps PyTorch's per-tensor step counts (else apex's per-group count)."""
    return isinstance(opt, (ForeachAdamW, torch.optim.AdamW))


def _init_state(opt) -> None:
    for group in opt.param_groups:
        if not _is_torch(opt):
            group["step"] = 0
        for p in group["params"]:
            state = opt.state[p]
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if _is_torch(opt):
                # PyTorch keeps the step on the device for fused kernels and on the CPU otherwise.
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")


def moments(opt, p) -> tuple:
    state = opt.state[p]
    return state["exp_avg"], state["exp_avg_sq"]


def set_step(opt, step: int) -> None:
    for group in opt.param_groups:
        if _is_torch(opt):
            for p in group["params"]:
                opt.state[p]["step"].fill_(step)
        else:
            group["step"] = step


def state_tensors(opt) -> list:
    return [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]

"""Pick the fastest AdamW at run time and give uniform access to its per-tensor state.

CUDA tensors: apex's FusedAdam when it imports and its CUDA extension is built, else PyTorch's fused
AdamW. Other devices: PyTorch's foreach AdamW. State is created eagerly (zero moments, step 0) so that
its size can be measured and a checkpoint loaded before the first step.
"""
from __future__ import annotations

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
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
    _init_state(opt)
    return opt


def _is_torch(opt) -> bool:
    return isinstance(opt, torch.optim.AdamW)


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

"""Whether a compiled loop still trains what its eager self trains: each parameter's gradient on one microbatch,
the loop's compiled layers against the same layers forced eager (torch.compiler.set_stance("force_eager")).

Why the training section runs it: the H200 run of 2026-11-27 timed the plain loop's compiled step at 459 ms, and
its profile put 262.6 ms of device time on 326 matrix products. The model's products carry 243 TFLOP a step (the
engine's 390 ran at 739 TFLOP/s), so the plain loop's would have run at 925 TFLOP/s, 1.15x the card's measured
matmul rate: that step did not compute them all. The learning rate is still warming up over the first steps a row
times, so neither its loss nor the others' could show a gradient gone missing; a speed row is only comparable with
the others if its gradients are the ones its eager step computes.

The eager gradients go to host memory while the compiled ones are computed (one more set of the model's gradients
on the device, not two, beside the three loops resident).
"""
from __future__ import annotations

import torch

from engine.parallel import grad_accumulation

# The largest relative difference accepted. The same bf16 step summed in another order differs by ~1e-3 (the CPU's
# inductor against eager on the tiny model: 8e-4 at worst), more through 16 layers; a gradient that lost or doubled
# one of its terms differs by tens of percent or more.
TOLERANCE = 5e-2


def trainable(loop) -> list:
    """(name, parameter) of each parameter `loop.model` trains."""
    return [(n, p) for n, p in loop.model.named_parameters() if p.requires_grad]


def loss(loop, batch):
    """`loop`'s mean loss on `batch`, under its autocast."""
    with torch.autocast(batch["tokens"].device.type, dtype=loop.autocast, enabled=loop.autocast is not None):
        return loop.loss(batch)


def gradients(loop, batch) -> list:
    """Every trainable parameter's gradient of `loop`'s mean loss on `batch` (None where nothing reaches it),
    through torch.autograd.grad, so nothing is accumulated into the loop's own gradients or buffers."""
    params = [p for _, p in trainable(loop)]
    # unfused: the engine's linears would add their weights' gradients into its grad buffer instead of returning
    # them (engine.parallel.grad_accumulation); compiled layers never fuse, so the two sides compare like with like
    with grad_accumulation.unfused():
        return list(torch.autograd.grad(loss(loop, batch), params, allow_unused=True))


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius), in fp32 on got's device."""
    want = want.to(got.device).float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def compiled_vs_eager(loop, batch) -> dict:
    """{params, missing (how many gradients the eager step computes and the compiled one does not, or leaves all
    zero), missing_first (their first names), worst_rel_diff, worst_param, match}: `loop`'s compiled gradients
    against its eager ones on `batch`."""
    names = [n for n, _ in trainable(loop)]
    with torch.compiler.set_stance("force_eager"):
        eager = [None if g is None else g.to("cpu") for g in gradients(loop, batch)]
    compiled = gradients(loop, batch)
    missing, diffs = [], {}
    for name, e, c in zip(names, eager, compiled):
        if e is None:
            continue
        if c is None or (not torch.count_nonzero(c) and torch.count_nonzero(e)):
            missing.append(name)
            continue
        diffs[name] = relative_difference(c, e)
    worst = _worst(diffs)
    return {"params": len(names), "missing": len(missing), "missing_first": missing[:8], **worst,
            "match": not missing and worst["worst_rel_diff"] <= TOLERANCE}


def fused_vs_unfused(loop, batch) -> dict:
    """The engine loop's gradients on `batch` with gradient-accumulation fusion (each linear's weight gradient added
    into the fp32 buffer by its product: engine.parallel.grad_accumulation) against autograd's without it:
    {params, fused (how many parameters fuse), worst_rel_diff, worst_param, match}. The fused sums skip the bf16
    rounding of each microbatch's weight gradient, so the two differ by bf16's precision, not by lost terms. The
    buffer is left mid-step; the loop's next step starts its own."""
    named = trainable(loop)
    unfused = [None if g is None else g.to("cpu") for g in gradients(loop, batch)]
    loop.trainer.optimizer.start_step(1)
    loss(loop, batch).backward()
    worst = _worst({name: relative_difference(p.main_grad, want) for (name, p), want in zip(named, unfused)
                    if want is not None})
    return {"params": len(named), "fused": grad_accumulation.fused_count(p for _, p in named), **worst,
            "match": worst["worst_rel_diff"] <= TOLERANCE}


def _worst(diffs: dict) -> dict:
    """{worst_rel_diff, worst_param} of {name: relative difference} (0.0 and None when empty)."""
    name = max(diffs, key=diffs.get, default=None)
    return {"worst_rel_diff": diffs[name] if name is not None else 0.0, "worst_param": name}

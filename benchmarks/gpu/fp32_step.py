"""One fp32 training step on the device against the same step on the CPU: the engine computes the same thing.

The engine's model and optimizer (build_model_chunks + build_optimizer on ParallelContext.virtual(), as one
rank of a real run builds them) take one AdamW step from the same weights on the same random batch, once on
the CPU and once on the device, TF32 off (matmul and cuDNN) so that the device rounds like fp32. Compared:
the loss, the gradient norm, every gradient (‖a − b‖ / ‖b‖, the worst tensor) and the updated weights of the whole
model, each to 1e-5 (EQUAL says why not each weight tensor); the worst weight tensor and the update itself
(weights after minus before, far smaller than the weights) are reported too.
In fp32 the attention runs through SDPA (kernels/dispatch.py: the Triton kernel would compute in tf32).
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from benchmarks.gpu import models
from kernels import dispatch

TOLERANCE = 1e-5
LR = 1e-3
# What must agree within TOLERANCE: the loss, the gradient norm, every parameter's gradient, and the weights after
# the step over the whole model. Not each tensor's weights: AdamW's first step moves every element by about
# lr * sign(g), so an element whose gradient is rounding noise moves either way (GPT-2's key bias, whose gradient
# is exactly zero in exact arithmetic, differed by 1e-3 on the H100 though every gradient agreed to 1e-6); the
# worst tensor is reported beside.
EQUAL = ("loss_rel_diff", "grad_norm_rel_diff", "worst_grad_rel_diff", "model_weights_rel_diff")


@contextlib.contextmanager
def tf32_off():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def one_step(cfg, device: str, weights=None) -> dict:
    """Loss, grad norm, weights before and after one engine step on `device` (from `weights` if given)."""
    from engine.loss import mean_loss
    from engine.optim import build_optimizer
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    ctx = ParallelContext.virtual()
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device=device, dtype=torch.float32)
    model = chunks[0]
    if weights is not None:
        model.load_state_dict(weights)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(cfg, chunks, ctx)
    g = torch.Generator().manual_seed(0)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    data = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=g).to(device)
    model.train()
    opt.start_step(1)
    loss = mean_loss(model(tokens=data[:, :-1], labels=data[:, 1:]))
    opt.scale_loss(loss).backward()
    opt.finish_grad_sync()
    grads = {n: p.main_grad.detach().cpu().clone() for n, p in model.named_parameters() if hasattr(p, "main_grad")}
    result = opt.step(LR)
    after = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"loss": loss.item(), "grad_norm": result.grad_norm, "before": before, "after": after, "grads": grads}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _worst(got: dict, ref: dict, n: int = 3) -> list:
    """The `n` tensors that differ most, as [name, relative difference]."""
    diffs = sorted(((_rel(got[k], ref[k]), k) for k in ref), reverse=True)[:n]  # 0 where both are zero
    return [[k, float(f"{d:.3g}")] for d, k in diffs]


def compare(family: str, device: str, reference_kernels: bool = False) -> dict:
    """The device step against the CPU step for `family` ("llama" or "gpt2"): each difference and whether all
    are within TOLERANCE; `reference_kernels`: the device runs the fused ops' PyTorch references."""
    cfg = models.config(family, "small", micro_batch=2, microbatches=1, iters=1, bf16=False)
    with tf32_off():
        ref = one_step(cfg, "cpu")
        # reference_kernels: the fused ops take kernels.reference's PyTorch path on CUDA too (where a difference
        # comes from: the Triton kernels, or cuBLAS and SDPA)
        with mock.patch.object(dispatch, "triton_available", lambda: False) if reference_kernels \
                else contextlib.nullcontext():
            got = one_step(cfg, device, ref["before"])
    return {"family": family, "device": device, "reference": "cpu",
            "kernels": "reference" if reference_kernels else "fused", **judge(got, ref)}


def judge(got: dict, ref: dict) -> dict:
    """Every difference between two one_step results, and whether those in EQUAL are within TOLERANCE."""
    weights = max(_rel(got["after"][k], ref["after"][k]) for k in ref["after"])
    updates = max(_rel(got["after"][k] - got["before"][k], ref["after"][k] - ref["before"][k])
                  for k in ref["after"] if (ref["after"][k] != ref["before"][k]).any())
    out = {"loss": ref["loss"], "loss_rel_diff": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
           "grad_norm_rel_diff": abs(got["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"]),
           "weights_rel_diff": weights, "update_rel_diff": updates, "tolerance": TOLERANCE,
           "worst_grads": _worst(got["grads"], ref["grads"]), "worst_weights": _worst(got["after"], ref["after"]),
           "model_weights_rel_diff": _rel(torch.cat([got["after"][k].flatten() for k in ref["after"]]),
                                          torch.cat([ref["after"][k].flatten() for k in ref["after"]]))}
    out["worst_grad_rel_diff"] = out["worst_grads"][0][1] if out["worst_grads"] else 0.0
    out["equal"] = all(out[k] <= TOLERANCE for k in EQUAL)
    return out

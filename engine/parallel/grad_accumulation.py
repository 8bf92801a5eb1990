"""Gradient-accumulation fusion, as Megatron-LM does it by default: a linear's weight-gradient product is added
into the parameter's fp32 gradient (`main_grad`, engine.optim.grad_buffer) by the matrix product itself (beta 1),
instead of being written in the weights' dtype and then added by a kernel of its own.

Why: with bf16 weights the unfused step writes each weight gradient in bf16, then reads it and the fp32 gradient and
writes that back: a launch and 10 bytes an element for every weight and microbatch. On the H200 of 2026-11-27 those
adds took 14.6 ms of the 1.3B Llama's ~500 ms step (engine/optim/grad_buffer.py, 260 launches; benchmarks/results/
NOTES.md section 11). Fused, the product's epilogue reads and writes the fp32 gradient instead. The numbers change
in one way: the microbatch's weight gradient is no longer rounded to bf16 before it is summed (Megatron-LM's
`--gradient-accumulation-fusion` does the same).

Who fuses: the grad buffer gives each of its parameters a sink (`attach`) when the run asks for the fusion (on unless
`--no-gradient-accumulation-fusion`) and `supported(device, dtype)`. That is CUDA, where torch's addmm writes fp32
from bf16 or fp16 operands (aten::addmm.dtype_out; a probe checks once that this torch has it, and a run on one
that lacks it says so and runs unfused). On the CPU the fusion is never on: the CPU build has no mixed-dtype addmm,
and its fp32 path stays the one the oracles (megatron-core, transformers) are compared with bit for bit. The tests
switch `supported` on for fp32 on the CPU to run this code.

How: the linear's backward adds dy^T x into the sink's target and returns no gradient for the weight. Autograd still
runs the weight's accumulate node, once per backward, so the grad buffer's post-accumulate hook still counts the
arrival (and adds whatever other uses of the weight left in `.grad`: a tied embedding's lookup). A split backward's
W pass does the same for a deferred weight (engine.parallel.weight_grad_store).

Not fused: a compiled region (its backward is traced, and the addition into the buffer is a side effect the trace
would not keep: compiled layers take autograd's products), FP8's GEMMs and the experts' grouped GEMMs (autograd
functions of their own, whose products are not addmm), and anything inside `unfused()`: `torch.autograd.grad`
returns gradients instead of accumulating them, so its callers wrap it (the fused weight's gradient would otherwise
be missing from its answer and added to the buffer instead).
"""
from __future__ import annotations

import contextlib
import functools

import torch

_SINK = "grad_sink"  # the attribute a parameter's sink lives in
_off = 0  # depth of unfused() contexts


def attach(p, sink) -> None:
    """Give `p` its sink, or take it away (None): an object with `target()` (the fp32 tensor shaped like p that its
    gradient is summed into now, or None when there is none: the linear then returns the gradient) and
    `arrived()` (count a gradient that went into the target, for a W pass, where no accumulate node runs)."""
    setattr(p, _SINK, sink)


def fusing(weight):
    """The sink `weight`'s gradient is to be added into now, or None: unfused where it has none, within
    `unfused()` and while compiling."""
    sink = getattr(weight, _SINK, None)
    if sink is None or _off or torch.compiler.is_compiling():
        return None
    return sink


def fused_count(params) -> int:
    """How many of `params` have their gradients fused now."""
    return sum(fusing(p) is not None for p in params)


@contextlib.contextmanager
def unfused():
    """Within: every linear returns its weight's gradient to autograd (for torch.autograd.grad and its callers)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def accumulate(target: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """target += dy^T x summed over every token, by one matrix product writing fp32. `target` is shaped like the
    weight ([..., out, in]: a stacked SwiGLU weight's leading dims are output rows), x [..., in], dy [..., out]."""
    out = target.view(-1, target.shape[-1])
    dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if dy.dtype == out.dtype:  # out= rather than addmm_: the profiler names both aten::addmm (benchmarks.gpu.bench)
        torch.addmm(out, dy.t(), x, out=out)
    else:
        torch.addmm(out, dy.t(), x, out_dtype=out.dtype, out=out)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on `device` can have their gradients fused (see the module's docstring)."""
    return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and \
        probe(dtype) is None


@functools.cache
def probe(dtype: torch.dtype):
    """None when CUDA's addmm adds a product of `dtype` operands into an fp32 tensor in place and right, else why
    not (this torch's error, or the wrong number it gave)."""
    return None if dtype == torch.float32 else sum_check("cuda", dtype)


def sum_check(device: str, dtype: torch.dtype):
    """`accumulate` of a tiny product of `dtype` operands into an fp32 tensor on `device`: None if it gave the right
    sum, else why not."""
    target = torch.full((2, 2), 0.5, device=device)
    ones = torch.ones((3, 2), dtype=dtype, device=device)  # three tokens: every element of dy^T x is 3
    try:
        accumulate(target, ones, ones)
    except (RuntimeError, TypeError) as e:
        return f"torch {torch.__version__}'s {device} addmm cannot add {dtype} products into fp32 ({e})".splitlines()[0]
    if not torch.equal(target, torch.full_like(target, 3.5)):
        return f"torch {torch.__version__}'s {device} addmm gave {target.flatten().tolist()} for 3.5 ({dtype} products)"
    return None


def describe(enabled: bool, device: torch.device, dtype: torch.dtype) -> str:
    """The run's line for it: on, or off and why."""
    if not enabled:
        return "off (--no-gradient-accumulation-fusion)"
    if device.type != "cuda":
        return f"off on {device.type} (CUDA only: the CPU's unfused products are the reference)"
    why = probe(dtype) if dtype in (torch.bfloat16, torch.float16) else None
    return "on" if why is None else f"off: {why}"

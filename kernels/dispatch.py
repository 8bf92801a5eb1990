"""The one place the model picks an implementation for each fused op: Triton on CUDA, PyTorch elsewhere.

Every function here has the same meaning on every device; `kernels.reference` defines it. The Triton
modules are imported lazily, on the first CUDA tensor, so this module imports cleanly without triton
and a CPU run never compiles anything. Attention has several backends; `resolve_attention_backend`
turns the `--attention-backend` choice into the one that will run (the start-up banner shows it), and
`attention_fn` gives its implementation, which each attention layer keeps.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

from kernels import reference

ATTENTION_BACKENDS = ("auto", "flash", "triton", "sdpa", "local")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install is as good as none: fall back to the references
        return False
    return True


@functools.lru_cache(maxsize=None)
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _triton_module(name: str):
    return importlib.import_module(f"kernels.{name}")


def _on_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs its Triton kernel. Not while torch.compile traces: there the reference's few
    PyTorch ops are what inductor fuses into kernels of its own (with their neighbours), where the launch of a
    hand-written kernel inside an autograd.Function is what dynamo could not trace on the H100 run."""
    return t.is_cuda and triton_available() and not torch.compiler.is_compiling()


def rms_norm(x, weight, eps):
    if _on_triton(x):
        return _triton_module("norm_triton").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    if _on_triton(x):
        return _triton_module("norm_triton").layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def add_rms_norm(x, residual, weight, eps):
    """Returns (rms_norm(x + residual), x + residual) in one pass over memory."""
    if _on_triton(x):
        return _triton_module("norm_triton").add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def add_layer_norm(x, residual, weight, bias, eps):
    """Returns (layer_norm(x + residual), x + residual) in one pass over memory."""
    if _on_triton(x):
        return _triton_module("norm_triton").add_layer_norm(x, residual, weight, bias, eps)
    return reference.add_layer_norm(x, residual, weight, bias, eps)


def apply_rope(x, freqs):
    """x [s, b, n, d], freqs [s, d/2] fp32 angles (or [s, b, d/2]: each sample's own); rotate-half convention."""
    if _on_triton(x):
        return _triton_module("rope_triton").apply_rope(x, freqs)
    return reference.apply_rope(x, freqs)


def swiglu(gate, up):
    if _on_triton(gate):
        return _triton_module("swiglu_triton").swiglu(gate, up)
    return reference.swiglu(gate, up)


def swiglu_stacked(y):
    """SwiGLU of a fused gate/up projection's output y = [gate | up] (last dim), whose gradient comes back as one
    tensor like y (no concatenation of the halves' gradients). A compiled graph takes the halves (`swiglu`), as it
    did before this existed (the H200 ran it so): there a kernel writing two views of one tensor would be a mutation
    of aliased arguments for the compiler to track, untried on a GPU."""
    if _on_triton(y) and not torch.compiler.is_compiling():
        return _triton_module("swiglu_triton").swiglu_stacked(y)
    return swiglu(*y.chunk(2, dim=-1))


def _fp8(t: torch.Tensor):
    """Where the FP8 code functions for `t` live (the same names and meaning in both)."""
    return _triton_module("fp8_triton") if _on_triton(t) else reference


def fp8_codes(x, scale, dtype, want_amax, into=None):
    """x [M, K]'s FP8 codes and their transpose in one pass: (codes, codes transposed, amax), kernels.reference's;
    `into`: a running amax the tensor's is max-ed into in place (one launch on CUDA, no separate reduction)."""
    return _fp8(x).fp8_codes(x, scale, dtype, want_amax, into)


def swiglu_fp8(gate, up, scale, dtype, want_amax, into=None):
    """SwiGLU's output as FP8 codes without its bf16 copy: (codes, codes transposed, amax), kernels.reference's."""
    return _fp8(gate).swiglu_fp8(gate, up, scale, dtype, want_amax, into)


def swiglu_grad_fp8(gate, up, dy, scale, dtype, want_amax, into=None):
    """SwiGLU's input gradient [d gate | d up] as FP8 codes, as swiglu_fp8 gives its output's."""
    return _fp8(gate).swiglu_grad_fp8(gate, up, dy, scale, dtype, want_amax, into)


def ce_stats(logits, target, vocab_start, valid_cols):
    """Per-row (max, sum exp(logit - max), target logit or 0) over this shard's valid columns, all fp32 [N]."""
    if _on_triton(logits):
        return _triton_module("ce_triton").ce_stats(logits, target, vocab_start, valid_cols)
    return reference.ce_stats(logits, target, vocab_start, valid_cols)


def ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax, coef_onehot, inplace=False):
    """coef_softmax * softmax(logits) - coef_onehot * onehot(target), in logits.dtype; overwrites logits if inplace."""
    if _on_triton(logits):
        return _triton_module("ce_triton").ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax,
                                                   coef_onehot, inplace)
    return reference.ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax, coef_onehot, inplace)


def resolve_attention_backend(name: str, device, dropout_p: float = 0.0, dtype: Optional[torch.dtype] = None) -> str:
    """The concrete backend `attention(..., backend=name)` runs on `device`; ValueError if it cannot run there."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "flash":
        if not flash_attn_available():
            raise ValueError("--attention-backend flash needs the flash-attn package, which is not installed; "
                             "pip install flash-attn, or use --attention-backend auto")
        if not cuda or not half:
            raise ValueError(f"--attention-backend flash runs only on CUDA in fp16/bf16, not {device.type} "
                             f"{dtype}; use --attention-backend auto")
    if name == "triton":
        if not cuda or not triton_available():
            raise ValueError(f"--attention-backend triton needs a CUDA device and the triton package "
                             f"(device {device.type}, triton {'present' if triton_available() else 'missing'}); "
                             f"use --attention-backend auto")
        if dropout_p > 0.0:
            raise ValueError("--attention-backend triton does not implement attention dropout; set "
                             "--attention-dropout 0 or use --attention-backend sdpa")
    if name != "auto":
        return name
    # fp32 goes to SDPA: both fused kernels would compute it in tf32 (flash-attn refuses it outright).
    if cuda and half and flash_attn_available():
        return "flash"
    if cuda and half and triton_available() and dropout_p == 0.0:
        return "sdpa-fused"
    return "sdpa"


def _expand_kv_heads(q) -> bool:
    """Whether SDPA gets each key/value head repeated for its queries instead of enable_gqa. On CUDA only the
    flash kernel (half precision) and the math one take grouped-query heads; in fp32 the math kernel would keep
    the [b, heads, s, s] probabilities for backward (the H100 run measured them), where the memory-efficient
    kernel, given whole heads, keeps none."""
    return q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16)


def _sdpa(q, k, v, causal, dropout_p, softmax_scale, window=None, doc_bounds=None):
    """torch's scaled_dot_product_attention. A window or packed documents go in as a boolean mask built from
    positions ([s, s], or [b, 1, s, s] per sample): the fused kernels that take one (memory-efficient on CUDA,
    the CPU flash kernel) read the mask but skip no block, the price of this path, which runs where the
    block-skipping kernels cannot (fp32, attention dropout). flex_attention would skip blocks but needs
    torch.compile (dynamo: seconds per process, and a graph per mask), and torch's varlen_attn (cu_seqlens,
    window_size: the form packed documents take in flash-attention) is flash-attention: CUDA, half precision, no
    dropout, none of which is this path's case."""
    group = q.shape[2] // k.shape[2]
    mask = None
    if window is not None or doc_bounds is not None:
        positions = torch.arange(q.shape[1], device=q.device)
        mask, causal = reference.visible(positions, positions, causal, window, doc_bounds), False
        mask = mask if doc_bounds is None else mask[:, None]
    if group > 1 and _expand_kv_heads(q):
        k, v, group = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), 1
    # SDPA wants [b, heads, s, d]; grouped-query heads are handled by enable_gqa (torch >= 2.5).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
                                         enable_gqa=bool(group > 1))  # a plain bool under torch.compile too
    return out.transpose(1, 2)


def cu_seqlens(doc_bounds: torch.Tensor) -> tuple:
    """(cumulative lengths [documents + 1] int32, longest length) of the documents of every sample laid end to end,
    flash-attention's varlen form of packed documents, from the [2, b, s] bounds."""
    b, s = doc_bounds.shape[1:]
    starts = torch.nonzero((doc_bounds[0] == torch.arange(s, device=doc_bounds.device)).reshape(-1)).reshape(-1)
    cu = torch.cat((starts, starts.new_tensor([b * s]))).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _flash(q, k, v, causal, dropout_p, softmax_scale, window=None, doc_bounds=None):
    """The flash-attn package; its window_size=(left, right) counts keys as --window-size does, -1 unbounded.
    Packed documents go through its varlen API: every sample's documents as one batch of sequences."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    window_size = (-1, -1) if window is None else (window, 0 if causal else -1)
    if doc_bounds is None:
        return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
    (b, s), cu = q.shape[:2], cu_seqlens(doc_bounds)
    flat = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
    out = flash_attn_varlen_func(*flat, cu[0], cu[0], cu[1], cu[1], dropout_p=dropout_p, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size)
    return out.view(q.shape)


def _triton_flash(q, k, v, causal, dropout_p, softmax_scale, window=None, doc_bounds=None):
    if torch.compiler.is_compiling():  # as the other fused ops: the same attention in ops a compiler can trace
        return _sdpa(q, k, v, causal, dropout_p, softmax_scale, window, doc_bounds)
    return _triton_module("flash_triton").flash_attention(q, k, v, causal, softmax_scale, window, doc_bounds)


def _fused_sdpa_backends():
    from torch.nn.attention import SDPBackend
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _sdpa_fused(q, k, v, causal, dropout_p, softmax_scale, window=None, doc_bounds=None):
    """What `auto` runs on CUDA in half precision without flash-attn: whole (causal or full) attention through
    SDPA's fused kernels, cuDNN's first, then flash's and the memory-efficient one (on the H100 of
    benchmarks/results/gpu-h100-80gb-hbm3-2026-11-26.json, causal fwd+bwd at head dim 128, seq 2048: cuDNN 376,
    SDPA-flash 213, the Triton kernel 182 TFLOP/s); a window or packed documents go to the Triton kernel, which
    skips the blocks they hide where SDPA would read a mask. Under torch.compile too: dynamo keeps the backend
    list's priority (torch >= 2.7) and the compiled graph calls the kernel it picks. Left to SDPA's own order
    (flash first), compiled layers ran SDPA-flash, 1.55-1.9x slower than cuDNN's on the H200 (benchmarks/results/
    gpu-h200-2026-11-26.json), where the eager engine ran cuDNN's (its profile there). tests/test_compiled_layer.py
    checks the capture has no break, test_gpu_auto_attention_keeps_its_kernel_under_torch_compile the kernel."""
    if window is not None or doc_bounds is not None:
        return _triton_flash(q, k, v, causal, dropout_p, softmax_scale, window, doc_bounds)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(_fused_sdpa_backends(), set_priority=True):
        return _sdpa(q, k, v, causal, dropout_p, softmax_scale)


_ATTENTION = {"flash": _flash, "triton": _triton_flash, "sdpa": _sdpa, "sdpa-fused": _sdpa_fused,
              "local": reference.attention}


def attention_fn(backend: str):
    """The implementation of a resolved backend (not "auto"): f(q, k, v, causal, dropout_p, softmax_scale, window,
    doc_bounds), `window` the keys a query sees before it (None: all), `doc_bounds` [2, b, s] int32 the first and
    last position of each position's document (None: one sequence per sample).

    A layer resolves its backend once (`resolve_attention_backend`) and keeps the function."""
    return _ATTENTION[backend]


def _triton_block_forward(q, k, v, causal, softmax_scale=None, dropout_p=0.0, seed=None, window=None, q_offset=0,
                          k_offset=0, doc_bounds=None):
    assert dropout_p == 0.0, "the Triton flash kernel has no dropout (validation refuses the combination)"
    return _triton_module("flash_triton").forward(q, k, v, causal, softmax_scale, window, q_offset, k_offset,
                                                  doc_bounds)


def _triton_block_backward(do, q, k, v, out, lse, causal, softmax_scale=None, dropout_p=0.0, seed=None, window=None,
                           q_offset=0, k_offset=0, doc_bounds=None):
    do, out, lse = (t.contiguous() for t in (do, out, lse))  # slices of the merged whole
    return _triton_module("flash_triton").backward(do, q, k, v, out, lse, causal, softmax_scale, window, q_offset,
                                                   k_offset, doc_bounds)


def attention_block_backend(backend: str, device) -> str:
    """The kernels blockwise (context-parallel) attention uses for a resolved `backend`: the Triton flash
    kernel, which returns the log-sum-exp that blocks are merged by, where attention would run a fused
    kernel on CUDA; the PyTorch reference otherwise (CPU, fp32, or attention dropout)."""
    fused = backend in ("flash", "triton", "sdpa-fused") and torch.device(device).type == "cuda" and triton_available()
    return "triton" if fused else "reference"


_BLOCKS = {"triton": (_triton_block_forward, _triton_block_backward),
           "reference": (reference.attention_block_forward, reference.attention_block_backward)}


def attention_block_fns(block_backend: str) -> tuple:
    """(forward, backward) of one attention block: forward(q, k, v, causal, scale, dropout_p, seed, window,
    q_offset, k_offset, doc_bounds) -> (out, lse [b, nq, sq] fp32); backward(do, q, k, v, out, lse, causal, scale,
    dropout_p, seed, window, q_offset, k_offset, doc_bounds) -> (dq, dk, dv), given the merged `out` and `lse` of
    the whole row; the offsets are the positions of the block's first query and key, and `doc_bounds` the whole
    sequence's (kernels.reference documents both)."""
    return _BLOCKS[block_backend]


def attention(q, k, v, causal=True, dropout_p=0.0, backend="auto", softmax_scale=None, window=None, doc_bounds=None):
    """q [b, s, nq, d], k and v [b, s, nkv, d] (query head j uses kv head j // (nq // nkv)) -> [b, s, nq, d].

    Resolves `backend` on every call: for tests and benchmarks; the model resolves once per layer."""
    chosen = resolve_attention_backend(backend, q.device, dropout_p, q.dtype)
    return attention_fn(chosen)(q, k, v, causal, dropout_p, softmax_scale, window, doc_bounds)


def kernel_report(device, attention_backend: str = "auto", dropout_p: float = 0.0,
                  dtype: Optional[torch.dtype] = None) -> dict:
    """Which implementation each op uses on `device`, for the start-up banner (attention as resolved for
    the training dropout and activation dtype; dtype None means fp16/bf16)."""
    fused = "triton" if torch.device(device).type == "cuda" and triton_available() else "reference"
    report = {op: fused for op in ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "apply_rope",
                                   "swiglu", "cross_entropy")}
    report["attention"] = resolve_attention_backend(attention_backend, device, dropout_p, dtype)
    return report

"""PyTorch references for every fused kernel: the CPU path and the oracle the Triton kernels are tested against.

Each function computes in fp32 and returns the input's dtype, which is what the kernels do too, so the
two agree to rounding. Everything here is differentiable by autograd except the cross-entropy
primitives, which the engine's autograd Function (engine/parallel/cross_entropy.py) wires together.
The norms, RoPE and SwiGLU are autograd Functions with their backward written out, so that what they
keep for backward is what the gradient needs and no more (the input and 1/rms, the angle table, gate
and up), as the Triton kernels do; tests/test_kernels.py checks each against autograd of the same
formula in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# Rows of logits converted to fp32 at a time by the cross-entropy references: 2**24 elements is 64 MiB,
# far below an fp32 copy of a real [tokens, vocab] matrix.
CE_CHUNK_ELEMENTS = 1 << 24


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or wider (float64 stays float64 so gradcheck can verify the written-out backwards)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def cast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself when it is already, with no `.to` call. Every autograd.Function's forward returns
    through this. Under torch 2.11's dynamo, a forward whose result is a `.to()` to the dtype it already has
    gives wrong gradients, silently: a compiled fp32 layer's norm weights and fc1 lost theirs on the CPU, and
    the H200's compiled plain loop (fp32 weights under autocast) ran 64 fewer products than its model needs
    (benchmarks/results/NOTES.md sections 11 and 13). torch 2.13 and 2.14 were right either way.
    tests/test_compiled_layer.py compares compiled fp32 gradients with eager ones."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * weight, keeping only x and 1/rms for backward (not the normalised copy)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return cast_to(xf * rstd * _wide(weight), x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat, dyf = _wide(x) * rstd, _wide(dy)
        g = dyf * _wide(weight)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return cast_to(dx, x.dtype), dw, None


class _LayerNorm(torch.autograd.Function):
    """y = (x - mean) / std * weight + bias, keeping x, the mean and 1/std for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        xf = _wide(x)
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        y = (xf - mean) * rstd * _wide(weight)
        return cast_to(y + _wide(bias) if bias is not None else y, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        xhat, dyf = (_wide(x) - mean) * rstd, _wide(dy)
        g = dyf * _wide(weight)
        dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        rows = dyf.reshape(-1, x.shape[-1])
        dw = (rows * xhat.reshape(rows.shape)).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = rows.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return cast_to(dx, x.dtype), dw, db, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return _LayerNorm.apply(x, weight, bias, eps)


def add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def add_layer_norm(x, residual, weight, bias, eps):
    s = x + residual
    return layer_norm(s, weight, bias, eps), s


def _rotate(x: torch.Tensor, freqs: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate the pairs (i, i + d/2) of x [s, b, n, d] by sign * freqs ([s, d/2], or [s, b, d/2] per sample), in
    fp32."""
    angles = _wide(torch.cat((freqs, freqs), dim=-1)).unsqueeze(-2)  # [s, 1, d] or [s, b, 1, d]
    if angles.dim() == 3:  # one table for every sample: [s, 1, 1, d] (unsqueezed, not viewed with a -1 size,
        angles = angles.unsqueeze(1)  # which torch 2.11's dynamo fails on in an autograd.Function with dynamic shapes)
    xf = _wide(x)
    x1, x2 = xf.chunk(2, dim=-1)
    return xf * angles.cos() + torch.cat((-x2, x1), dim=-1) * (sign * angles.sin())


class _Rope(torch.autograd.Function):
    """Keeps only the angles (one table per forward, shared by every layer); backward rotates back."""

    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        return cast_to(_rotate(x, freqs, 1.0), x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (freqs,) = ctx.saved_tensors
        return cast_to(_rotate(dy, freqs, -1.0), dy.dtype), None


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [s, b, n, d], freqs [s, d/2] angles shared by the samples or [s, b, d/2] of each sample's positions
    (packed documents under --reset-position-ids); rotate-half pairs (i, i + d/2)."""
    return _Rope.apply(x, freqs)


def swiglu_values(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32, in gate's dtype."""
    return cast_to(F.silu(_wide(gate)) * _wide(up), gate.dtype)


def swiglu_grads(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple:
    """SwiGLU's (d gate, d up) for the output gradient dy, silu recomputed, in gate's and up's dtypes."""
    gf, dyf = _wide(gate), _wide(dy)
    sig = torch.sigmoid(gf)
    dgate = dyf * _wide(up) * sig * (1.0 + gf * (1.0 - sig))
    return cast_to(dgate, gate.dtype), cast_to(dyf * gf * sig, up.dtype)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up (views of one fc1 output) and recomputing silu in backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_values(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return swiglu_grads(*ctx.saved_tensors, dy)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


def fp8_scale(amax: torch.Tensor, top, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """The FP8 encode scale for an amax (any shape; Transformer Engine's rule): top / amax / 2^margin, 1 where amax is
    0 or not finite; `top` the format's largest value (a float, or a tensor broadcast against amax); `pow2` rounds
    it down to a power of two. The division is by the reciprocal (what `top / tensor` computes in PyTorch), so a
    kernel reproduces it with a correctly rounded reciprocal and a product."""
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(ok, torch.where(ok, amax, 1.0).reciprocal() * top, 1.0) / (2.0 ** margin)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


@dataclass
class FromAmax:
    """An encode scale to derive from a tensor's amax (current scaling) where the codes are made: `fp8_scale(amax,
    the format's largest value, margin)`, its reciprocal written to `inv` (a 0-d fp32 tensor: the GEMM's decode
    scale). On CUDA the codes kernel does it, sparing the ten or so small operations apart."""
    amax: torch.Tensor
    margin: int
    inv: torch.Tensor


def encode_scale(scale, dtype) -> torch.Tensor:
    """The encode scale `scale` stands for: itself, or for a FromAmax the derived one (its reciprocal into .inv)."""
    if not isinstance(scale, FromAmax):
        return scale
    derived = fp8_scale(scale.amax, torch.finfo(dtype).max, scale.margin)
    scale.inv.copy_(derived.reciprocal())
    return derived


def check_into(into: Optional[torch.Tensor], want_amax: bool) -> None:
    """The codes functions' rule (here and kernels.fp8_triton's): a running amax to max into needs the amax taken."""
    if into is not None and not want_amax:
        raise ValueError("an amax to accumulate `into` needs want_amax")


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """x's FP8 codes under encode `scale`: fp32(x) * scale, saturated to the format's range, rounded to nearest
    (ties to even); a NaN stays NaN."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp_(-top, top).to(dtype)


def fp8_codes(y: torch.Tensor, scale, dtype, want_amax: bool, into: Optional[torch.Tensor] = None) -> tuple:
    """y [M, N] for a GEMM and, transposed, for another: (its codes under encode `scale` (fp8_cast; a tensor, or a
    FromAmax) or None without one, their transpose [N, M] contiguous or None, max |y| in fp32 (0 for no elements) or
    None). `into`: a 0-d fp32 tensor the amax is max-ed into in place (NaN kept), returned as the amax (a step's
    running amax)."""
    check_into(into, want_amax)
    top = (y.abs().amax().float() if y.numel() else y.new_zeros((), dtype=torch.float32)) if want_amax else None
    if into is not None:
        top = torch.maximum(into, top, out=into)
    if scale is None:
        return None, None, top
    codes = fp8_cast(y, encode_scale(scale, dtype), dtype)
    return codes, codes.t().contiguous(), top


def swiglu_fp8(gate: torch.Tensor, up: torch.Tensor, scale: Optional[torch.Tensor], dtype, want_amax: bool,
               into: Optional[torch.Tensor] = None) -> tuple:
    """SwiGLU's output [M, F] for gate and up [M, F] (any row strides) straight to FP8: (its codes under encode
    `scale`, their transpose, its amax) as `fp8_codes` gives them; the output itself is never kept. The values
    are swiglu's, rounded to gate's dtype."""
    return fp8_codes(swiglu_values(gate, up), scale, dtype, want_amax, into)


def swiglu_grad_fp8(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, scale: Optional[torch.Tensor], dtype,
                    want_amax: bool, into: Optional[torch.Tensor] = None) -> tuple:
    """SwiGLU's input gradient [M, 2F] = [d gate | d up] for dy [M, F] straight to FP8, as swiglu_fp8 gives the
    output's: the gradient fc1's output receives (gate and up its two halves)."""
    return fp8_codes(torch.cat(swiglu_grads(gate, up, dy), dim=-1), scale, dtype, want_amax, into)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Optional[int],
            doc_bounds: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Which keys each query sees, [sq, sk] bool, or [b, sq, sk] with documents, from their absolute positions: the
    rule of engine/attention_mask.py (j <= i when causal; i - j <= window when a window is set; with
    `doc_bounds` [2, b, S], the first and last position of each position's document, first(i) <= j <= last(i)).
    None: every key."""
    if not causal and window is None and doc_bounds is None:
        return None
    distance = q_pos[:, None] - k_pos[None, :]
    keep = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    keep = keep & (distance <= window) if window is not None else keep
    if doc_bounds is None:
        return keep
    first, last = (t[:, q_pos, None] for t in doc_bounds)  # [b, sq, 1] each
    return keep & (k_pos >= first) & (k_pos <= last)


def _positions(n: int, offset: int, device) -> torch.Tensor:
    return torch.arange(offset, offset + n, device=device)


def _scores(q, k, causal: bool, scale: float, window: Optional[int] = None, q_offset: int = 0,
            k_offset: int = 0, doc_bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled scores [b, nkv, group, sq, sk] in fp32 (or wider), -inf where the mask hides the key."""
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    scores = torch.einsum("bqhgd,bkhd->bhgqk", _wide(q).reshape(b, sq, nkv, nq // nkv, d), _wide(k)) * scale
    keep = visible(_positions(sq, q_offset, q.device), _positions(k.shape[1], k_offset, q.device), causal, window,
                   doc_bounds)
    if keep is not None and keep.dim() == 3:  # per sample: [b, 1, 1, sq, sk] against the heads' axes
        keep = keep[:, None, None]
    return scores if keep is None else scores.masked_fill(~keep, float("-inf"))


def _scale(q, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def attention(q, k, v, causal=True, dropout_p=0.0, softmax_scale=None, window=None, doc_bounds=None):
    """Materialised-scores attention in fp32. q [b, s, nq, d]; k, v [b, s, nkv, d]; returns [b, s, nq, d].
    `window`: each query sees the keys at most this many positions before it (None: all); `doc_bounds` [2, b, s]:
    the first and last position of each position's document, whose keys alone its query sees (None: one
    sequence)."""
    b, s, nq, d = q.shape
    # Query head j reads kv head j // group: the scores view the query heads as [nkv, group].
    probs = _scores(q.float(), k.float(), causal, _scale(q, softmax_scale), window, doc_bounds=doc_bounds)
    probs = probs.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(b, s, nq, d).to(q.dtype)


def attention_lse(q, k, causal=True, softmax_scale=None, window=None, doc_bounds=None) -> torch.Tensor:
    """Natural-log log-sum-exp of the scaled scores, [b, nq, s] fp32 (what the flash kernel saves)."""
    b, s, nq, d = q.shape
    scores = _scores(q.float(), k.float(), causal, _scale(q, softmax_scale), window, doc_bounds=doc_bounds)
    return scores.logsumexp(dim=-1).reshape(b, nq, s)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with 0 for rows that see no key (-inf), so that exp(scores - lse) is 0 there, not nan."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_dropout(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
    """The kept-and-rescaled mask of one block, drawn from its own generator so backward can redraw it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    keep = torch.rand(shape, generator=gen, device=device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def attention_block_forward(q, k, v, causal: bool, softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                            seed: Optional[int] = None, window: Optional[int] = None, q_offset: int = 0,
                            k_offset: int = 0, doc_bounds: Optional[torch.Tensor] = None) -> tuple:
    """One block of blockwise (ring) attention: (out [b, sq, nq, d], lse [b, nq, sq]), both fp32 (or wider).

    `out` is normalised by this block's own log-sum-exp and kept wide: blocks are merged by their lse, and the
    caller casts the merged result. The mask is decided from positions: the queries are at q_offset.., the
    keys at k_offset.. (`causal`, `window` and `doc_bounds` as in `attention`: the bounds are the whole
    sequence's, read at the block's positions); a row that sees no key of the block gets out 0 and lse -inf.
    Dropout uses a generator seeded by `seed`.
    """
    b, sq, nq, d = q.shape
    scores = _scores(q, k, causal, _scale(q, softmax_scale), window, q_offset, k_offset, doc_bounds)
    lse = scores.logsumexp(dim=-1)
    probs = (scores - _finite(lse)[..., None]).exp()
    if dropout_p > 0.0:
        probs = probs * _block_dropout(probs.shape, dropout_p, seed, q.device)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, _wide(v)).reshape(b, sq, nq, d)
    return out, lse.reshape(b, nq, sq)


def attention_block_backward(do, q, k, v, out, lse, causal: bool, softmax_scale: Optional[float] = None,
                             dropout_p: float = 0.0, seed: Optional[int] = None, window: Optional[int] = None,
                             q_offset: int = 0, k_offset: int = 0, doc_bounds: Optional[torch.Tensor] = None) -> tuple:
    """(dq, dk, dv) of one block, in fp32 (or wider), given the merged output `out` and its `lse`: with the
    whole row's lse the block's probabilities are final, so the blocks' gradients simply add up."""
    b, sq, nq, d = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    scale = _scale(q, softmax_scale)
    lse = _finite(lse.reshape(b, nkv, group, sq)[..., None].to(_wide(q).dtype))
    probs = (_scores(q, k, causal, scale, window, q_offset, k_offset, doc_bounds) - lse).exp()
    dof = _wide(do).reshape(b, sq, nkv, group, d)
    delta = (dof * _wide(out).reshape(b, sq, nkv, group, d)).sum(-1).permute(0, 2, 3, 1)  # [b, nkv, group, sq]
    dprobs = torch.einsum("bqhgd,bkhd->bhgqk", dof, _wide(v))
    kept = probs
    if dropout_p > 0.0:
        mask = _block_dropout(probs.shape, dropout_p, seed, q.device)
        kept, dprobs = probs * mask, dprobs * mask
    dv = torch.einsum("bhgqk,bqhgd->bkhd", kept, dof)
    ds = probs * (dprobs - delta[..., None]) * scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, _wide(k)).reshape(b, sq, nq, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, _wide(q).reshape(b, sq, nkv, group, d))
    return dq, dk, dv


def _row_chunks(logits: torch.Tensor):
    rows = max(1, CE_CHUNK_ELEMENTS // max(1, logits.shape[1]))
    for start in range(0, logits.shape[0], rows):
        yield start, min(start + rows, logits.shape[0])


def _local_target(target, vocab_start, valid_cols):
    local = target - vocab_start
    in_shard = (local >= 0) & (local < valid_cols)
    return local.clamp(0, max(valid_cols - 1, 0)), in_shard


def ce_stats(logits, target, vocab_start, valid_cols):
    """Per-row (max, sum of exp(logit - max), target logit or 0) over the first valid_cols columns."""
    n = logits.shape[0]
    local_max = torch.empty(n, dtype=torch.float32, device=logits.device)
    sumexp = torch.empty_like(local_max)
    local, in_shard = _local_target(target, vocab_start, valid_cols)
    for a, b in _row_chunks(logits):
        x = logits[a:b, :valid_cols].float()
        m = x.amax(dim=1)
        local_max[a:b] = m
        sumexp[a:b] = (x - m[:, None]).exp().sum(dim=1)
    target_logit = logits.gather(1, local[:, None]).squeeze(1).float()
    return local_max, sumexp, torch.where(in_shard, target_logit, torch.zeros_like(target_logit))


def ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax, coef_onehot, inplace=False):
    """coef_softmax * softmax - coef_onehot * onehot(target), zero on padding columns, in logits.dtype."""
    out = logits if inplace else torch.empty_like(logits)
    local, in_shard = _local_target(target, vocab_start, valid_cols)
    onehot_coef = torch.where(in_shard, coef_onehot, torch.zeros_like(coef_onehot))
    for a, b in _row_chunks(logits):
        x = logits[a:b, :valid_cols].float()
        g = (x - lse[a:b, None]).exp_().mul_(coef_softmax[a:b, None])
        g.scatter_add_(1, local[a:b, None], -onehot_coef[a:b, None])
        out[a:b, :valid_cols] = g.to(out.dtype)
        out[a:b, valid_cols:] = 0
    return out

"""PyTorch references for every fused kernel: the CPU path and the oracle the Triton kernels are tested against.

Each function computes in fp32 and returns the input's dtype, which is what the kernels do too, so the
two agree to rounding. Everything here is differentiable by autograd except the cross-entropy
primitives, which the engine's autograd Function (engine/parallel/cross_entropy.py) wires together.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

# Rows of logits converted to fp32 at a time by the cross-entropy references: 2**24 elements is 64 MiB,
# far below an fp32 copy of a real [tokens, vocab] matrix.
CE_CHUNK_ELEMENTS = 1 << 24


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def add_layer_norm(x, residual, weight, bias, eps):
    s = x + residual
    return layer_norm(s, weight, bias, eps), s


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [s, b, n, d], freqs [s, d/2] angles; rotate-half pairs (i, i + d/2)."""
    angles = torch.cat((freqs, freqs), dim=-1).float()[:, None, None, :]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * angles.cos() + rotated * angles.sin()).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def attention(q, k, v, causal=True, dropout_p=0.0, softmax_scale=None):
    """Materialised-scores attention in fp32. q [b, s, nq, d]; k, v [b, s, nkv, d]; returns [b, s, nq, d]."""
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    # Query head j reads kv head j // group: view the query heads as [nkv, group].
    qf = q.float().view(b, s, nkv, group, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    if causal:
        keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(b, s, nq, d).to(q.dtype)


def attention_lse(q, k, causal=True, softmax_scale=None) -> torch.Tensor:
    """Natural-log log-sum-exp of the scaled scores, [b, nq, s] fp32 (what the flash kernel saves)."""
    b, s, nq, d = q.shape
    nkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q.float().view(b, s, nkv, nq // nkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    if causal:
        keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.logsumexp(dim=-1).reshape(b, nq, s)


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

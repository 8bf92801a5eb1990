"""Cross-entropy over vocabulary-parallel logits, never gathering the full vocabulary.

Each TP rank holds logits for its vocabulary slice. Three all-reduces over the TP group give the
log-sum-exp and the target's logit: max (for stability), the sum of exp relative to it, and the target
logit (only the owning rank contributes). Backward is softmax - one-hot on the local slice, computed by
the kernel row chunk by row chunk, in place over the logits (the model never reads them again; a
caller that does, or that runs backward twice, asks for a separate buffer). Columns past the true
vocabulary are padding and take no part, so the loss is the same for every tp. At tp 1 this is the
whole single-device cross-entropy.

The optional z-loss (PaLM, Chowdhery et al. 2022, sec. 5) adds weight * lse^2 per token.
"""
from __future__ import annotations

import torch

from engine.parallel import comm
from kernels import dispatch


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, valid_cols, z_weight, inplace):
        if valid_cols:
            local_max, sumexp, target_logit = dispatch.ce_stats(logits, target, vocab_start, valid_cols)
        else:  # a shard made only of vocabulary padding (small vocab, large tp) contributes nothing
            local_max = torch.full(target.shape, float("-inf"), device=logits.device)
            sumexp, target_logit = torch.zeros_like(local_max), torch.zeros_like(local_max)
        if group is not None and comm.world_size(group) > 1:
            global_max = local_max.clone()
            comm.all_reduce(global_max, group, op=comm.ReduceOp.MAX)
            sumexp = sumexp * torch.exp(local_max - global_max)
            comm.all_reduce(sumexp, group)
            comm.all_reduce(target_logit, group)
        else:
            global_max = local_max
        lse = global_max + torch.log(sumexp)
        loss = lse - target_logit
        if z_weight:
            loss = loss + z_weight * lse * lse
        ctx.save_for_backward(logits, target, lse)
        ctx.vocab, ctx.inplace = (vocab_start, valid_cols, z_weight), inplace
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        vocab_start, valid_cols, z_weight = ctx.vocab
        grad_loss = grad_loss.float()
        coef_softmax = grad_loss * (1.0 + 2.0 * z_weight * lse) if z_weight else grad_loss
        if not valid_cols:
            return torch.zeros_like(logits), None, None, None, None, None, None
        grad = dispatch.ce_grad(logits, target, vocab_start, valid_cols, lse, coef_softmax, grad_loss,
                                inplace=ctx.inplace)
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, ctx, vocab_size: int, z_loss_weight: float = 0.0,
                                 inplace_backward: bool = True):
    """logits [N, V_padded/tp] (this rank's slice), target [N] -> per-token loss [N] (fp32)."""
    per_rank = logits.shape[-1]
    start = ctx.tp_rank * per_rank
    valid = max(0, min(per_rank, vocab_size - start))
    return _VocabParallelCE.apply(logits, target, ctx.tp_group, start, valid, float(z_loss_weight),
                                  inplace_backward)

"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron-LM's --mtp-num-layers, --mtp-loss-scaling-factor).

D sequential modules follow the decoder on the last pipeline stage. Module k (1..D) takes the normalised hidden
states of the one before it (for k = 1 the decoder's, through its final norm: what the main head reads) and the
embeddings of the tokens k positions ahead, normalises each with its own norm, projects their concatenation
[embedding; hidden] from 2h to h (`proj`, replicated over tp like MLA's down-projections), runs its own
transformer layer (built like the decoder's last: MoE where that is) and normalises its output with its own
final norm: what the shared output head reads to predict the token k + 1 ahead, and what module k + 1 takes.
This is megatron-core's MultiTokenPredictionBlock (0.16.1: the decoder's final layernorm comes before the MTP
block, each MTPLayer ends in its final_layernorm; checked in tests/test_megatron_checkpoint.py). The embedding
is the model's too (on the last stage of a pipeline, a copy kept equal to the first stage's like a tied
embedding's).

The inputs of module k at position i are token i + k and, as target, token i + k + 1 (`targets`, computed from
the whole microbatch before it is cut for context parallelism, so every layout sees the same ones); targets past
the sample's end, or under a loss mask of 0, do not count. Each module's loss is a token mean over the whole
microbatch like the LM loss (engine.loss); their mean times --mtp-loss-scaling-factor joins backward beside the
LM loss (`with_aux_loss`, scaled like it), which itself, and the logged `lm_loss`, stay the main head's alone.
`MTPStats` sums what the modules measured over the job once a step: the metrics key `mtp_loss` is the mean of
the D modules' losses.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.loss import microbatch_loss
from engine.parallel import comm
from engine.parallel.layers import Norm, ReplicatedLinear

KEYS = ("mtp_tokens", "mtp_labels", "mtp_mask")  # [b, s, D] tensors of a microbatch, cut along the sequence


def targets(batch: dict, depth: int) -> dict:
    """The whole microbatch's MTP inputs [b, s, depth] (token i + k at position i for module k, and token
    i + k + 1 as its target, with 0/1 where that target counts) and `mtp_count` [depth], each module's counted
    targets (at least one)."""
    tokens, labels = batch["tokens"], batch["labels"]
    s = tokens.shape[1]
    whole = torch.cat((tokens, labels[:, -1:]), dim=1)  # tokens 0 .. s
    mask = batch.get("loss_mask")
    mask = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.float()
    at = torch.arange(s, device=tokens.device)
    ins, outs, counted = [], [], []
    for k in range(1, depth + 1):
        ahead = (at + k).clamp(max=s - 1)
        ins.append(whole[:, (at + k).clamp(max=s)])
        outs.append(labels[:, ahead])
        counted.append(mask[:, ahead] * (at + k < s).float())
    mtp_mask = torch.stack(counted, dim=-1)
    return {"mtp_tokens": torch.stack(ins, dim=-1), "mtp_labels": torch.stack(outs, dim=-1), "mtp_mask": mtp_mask,
            "mtp_count": mtp_mask.sum((0, 1)).clamp(min=1.0)}


class MTPModule(nn.Module):
    """One prediction depth: its norms, projection, transformer `layer` (built by the model) and final norm."""

    def __init__(self, cfg, ctx, layer: nn.Module, device=None, dtype=None):
        super().__init__()
        h = cfg.hidden_size

        def norm():
            return Norm(h, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype)
        self.embedding_norm, self.hidden_norm = norm(), norm()
        self.proj = ReplicatedLinear(2 * h, h, ctx, std=cfg.init_method_std, device=device, dtype=dtype)
        self.layer = layer
        self.final_norm = norm()

    def forward(self, hidden, embedded, freqs, positions, documents=None):
        """The next depth's normalised hidden states [s, b, h] from the previous ones and the embeddings of the
        tokens ahead."""
        x = self.proj(torch.cat((self.embedding_norm(embedded), self.hidden_norm(hidden)), dim=-1))
        return self.final_norm(self.layer(x, freqs, positions, documents))


def module_losses(model, hidden, batch: dict, freqs, positions, documents) -> torch.Tensor:
    """[D] this rank's share of each module's loss for one microbatch (`batch`: its part of `targets`; `hidden`:
    the decoder's output through its final norm)."""
    losses = []
    for k, module in enumerate(model.mtp):
        hidden = module(hidden, model.mtp_embed(batch["mtp_tokens"][..., k]), freqs, positions, documents)
        per_token = model.head(hidden, batch["mtp_labels"][..., k])
        losses.append(microbatch_loss(per_token, batch["mtp_mask"][..., k], batch["mtp_count"][k]))
    return torch.stack(losses)


class MTPStats:
    """The MTP losses a step measured, summed over the job: `finish_step()` -> {"mtp_loss": mean over modules}."""

    def __init__(self, cfg, model_chunks: list, ctx, device):
        self.ctx, self.device, self.depth = ctx, device, cfg.model.mtp_num_layers
        self.models = [c for c in model_chunks if getattr(c, "mtp", None) is not None]

    def finish_step(self) -> dict:
        ctx = self.ctx
        table = torch.zeros(2, dtype=torch.float64, device=self.device)
        for model in self.models:
            sums, microbatches = model.mtp_measured
            if ctx.tp_rank == 0:  # every tp rank holds the same losses; the CP ranks' shares add up
                table[0] += float(sums.sum()) / self.depth
                table[1] += microbatches if ctx.cp_rank == 0 else 0
            model.reset_mtp_measured()
        if ctx.world_size > 1:
            comm.all_reduce(table)
        return {"mtp_loss": float(table[0] / table[1].clamp(min=1))}

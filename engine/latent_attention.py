"""Multi-head latent attention (DeepSeek-V2/V3, Megatron-LM's --multi-latent-attention).

Keys and values come from one low-rank latent per token: h -> kv_lora_rank (+ the decoupled RoPE key, one
qk_pos_emb_head_dim vector per token shared by every head) -> per head qk_head_dim key channels and v_head_dim
value channels. Queries come from h directly, or through a latent of q_lora_rank (--q-lora-rank). Each head's q
and k are [its qk_head_dim channels without position | qk_pos_emb_head_dim with RoPE]; the values are narrower
where v_head_dim < qk_head_dim + qk_pos_emb_head_dim, which the attention entry point takes as it is.

Under tensor parallelism the heads split: the up-projections are column-parallel (whole heads per rank) and the
output projection row-parallel; the down-projections to the latents (and their norms, --qk-layernorm under MLA
as in Megatron-LM) are replicated, computed on the tokens this rank holds, so under sequence parallelism the
all-gather carries the latents rather than the hidden states, and the shared RoPE key enters the region as
an activation (all-gathered or copied, `mappings.enter_tp`). Their weights' gradients cover this rank's tokens
under sequence parallelism and are summed over tp then (`sp_partial_grad`), as every replicated weight's.

Parameter names: `q` [heads*(qk+pos), h] (no q latent) or `q_down` [q_lora, h], `q_norm`, `q_up`
[heads*(qk+pos), q_lora]; `kv_down` [kv_lora+pos, h] (latent rows first, then the RoPE key's), `kv_norm`,
`kv_up` [heads*(qk+v), kv_lora] (each head's key rows, then its value rows); `proj` [h, heads*v].
"""
from __future__ import annotations

import torch
from torch import nn

from engine.parallel import mappings
from engine.parallel.attention import AttentionCore
from engine.parallel.layers import ColumnParallelLinear, Norm, ReplicatedLinear, RowParallelLinear
from engine.rope import softmax_scale, yarn_rope_scale
from kernels import dispatch


class LatentAttention(nn.Module):
    def __init__(self, cfg, ctx, out_std, device, dtype, layer: int):
        super().__init__()
        self.ctx = ctx
        h, heads, std = cfg.hidden_size, cfg.num_attention_heads, cfg.init_method_std
        self.nope, self.pos, self.v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        q_out = heads * (self.nope + self.pos)

        def norm(width):
            return Norm(width, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype) if cfg.qk_layernorm else None

        def column(width_in, width_out):
            return ColumnParallelLinear(width_in, width_out, ctx, bias=False, std=std, device=device, dtype=dtype)
        if self.q_rank:
            self.q_down = ReplicatedLinear(h, self.q_rank, ctx, std=std, device=device, dtype=dtype)
            self.q_norm = norm(self.q_rank)
            self.q_up = column(self.q_rank, q_out)
        else:
            self.q = column(h, q_out)
        self.kv_down = ReplicatedLinear(h, self.kv_rank + self.pos, ctx, std=std, device=device,
                                        dtype=dtype)
        self.kv_norm = norm(self.kv_rank)
        self.kv_up = column(self.kv_rank, heads * (self.nope + self.v))
        self.proj = RowParallelLinear(heads * self.v, h, ctx, bias=False, std=out_std, device=device, dtype=dtype)
        self.core = AttentionCore(cfg, ctx, layer, device, dtype)
        self.rope_scale = yarn_rope_scale(cfg)
        self.softmax_scale = softmax_scale(cfg, self.nope + self.pos)

    @staticmethod
    def _normed(norm, x):
        return x if norm is None else norm(x)

    def _queries(self, x):
        if self.q_rank:
            return self.q_up(self._normed(self.q_norm, self.q_down(x)))
        return self.q(x)

    def _rope(self, t, freqs):
        t = dispatch.apply_rope(t.contiguous(), freqs)
        return t if self.rope_scale == 1.0 else t * self.rope_scale

    def forward(self, x, freqs, documents=None):
        """x [s, b, h] (this rank's tokens) -> [s, b, h]; `documents`: the microbatch's packed documents or None."""
        q = self._queries(x)
        s, b = q.shape[:2]
        q_nope, q_pos = q.view(s, b, -1, self.nope + self.pos).split((self.nope, self.pos), dim=-1)
        latent, k_pos = self.kv_down(x).split((self.kv_rank, self.pos), dim=-1)
        kv = self.kv_up(self._normed(self.kv_norm, latent)).view(s, b, -1, self.nope + self.v)
        k_nope, v = kv.split((self.nope, self.v), dim=-1)
        k_pos = mappings.enter_tp(k_pos.contiguous(), self.ctx).unsqueeze(2)  # [s, b, 1, pos]: every head's
        q_pos, k_pos = self._rope(q_pos, freqs), self._rope(k_pos, freqs)
        q = torch.cat((q_nope, q_pos), dim=-1)
        k = torch.cat((k_nope, k_pos.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        return self.proj(self.core(q, k, v, documents, self.training, self.softmax_scale))

"""The GPT / Llama decoder, written once from tensor-parallel layers.

One class covers GPT-2/3 (LayerNorm, learned positions, exact or tanh GELU, biases, tied embeddings) and
Llama 2/3 (RMSNorm, rotary positions with optional Llama 3.1 scaling, SwiGLU, grouped-query attention, no
biases, untied output); Mistral is Llama-shaped and Qwen2 adds a bias to the QKV projection only; Qwen3
normalises q and k per head (QK-norm), and OLMo-2 over the whole projection, with its norms on each sublayer's
output rather than its input; DeepSeek-V2/V3 attend through a low-rank latent (--multi-latent-attention,
engine/latent_attention.py) and add multi-token prediction modules after the last layer (--mtp-num-layers,
engine/mtp.py, on the last stage). Each layer's attention mask (causal, with the sliding window where
--window-size gives that layer one) is its engine.attention_mask value, joined in each forward with the
microbatch's packed documents when it has them (--reset-attention-mask, engine/documents.py).
Activations are [s, b, h] between layers, or this rank's slice of the sequence where the parallel context
splits it (sequence parallelism: the context decides, the model asks it). The model sees whatever positions
of each sequence it is given (`positions`: the pipeline runner cuts a microbatch for context parallelism
before it gets here) and never asks how the sequence was cut; RoPE and the learned table read the positions,
shared by the samples, or each sample's own (`position_ids` [b, s], restarting with each packed document under
--reset-position-ids). A pipeline stage or virtual chunk is the same class holding a subset of the layers (by
global id, so parameter names do not depend on the layout), with the embedding on the first chunk
(`pre_process`) and final norm, output layer and loss on the last (`post_process`).

`forward(tokens=..., labels=...)` returns the loss of every token ([b, s], the z-loss included); how
those make a microbatch's loss is engine.loss's rule. Without labels it returns this rank's
vocabulary slice of the logits ([b, s, V/tp]); a middle stage maps `hidden` to `hidden`.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, padded_vocab_size
from engine.latent_attention import LatentAttention
from engine.moe.layer import MoELayer, with_aux_loss
from engine.mtp import MTPModule, module_losses
from engine.parallel import mappings
from engine.parallel.attention import AttentionCore
from engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.parallel.qk_norm import QKNorm
from engine.parallel.layers import (
    ColumnParallelLinear,
    Norm,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_weights,
    vocab_parallel_lookup,
    make_param,
    mark_tied,
)
from engine.parallel.recompute import recompute
from engine.qkv import split_qkv
from engine.rope import inverse_frequencies
from kernels import dispatch

WORD_EMBEDDING_KEY = "embedding.word.weight"  # the random stream both copies of a tied embedding are drawn from
TIED_EMBEDDING = "word.weight"  # the first stage's embedding: the last stage's tied copy is stored under this name


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx, out_std, device, dtype, layer: int):
        super().__init__()
        self.ctx, self.cfg = ctx, cfg
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.resolved_query_groups(), cfg.head_dim()
        per_group = self.heads // self.groups
        bias = not cfg.disable_bias_linear
        # Fused QKV in group-interleaved order [g0: q.. k v | g1: q.. k v | ...]: a row split by tp gives
        # each rank whole groups, so the full tensor is the same for every tp.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, self.groups * (per_group + 2) * self.head_dim, ctx,
                                        bias=bias or cfg.add_qkv_bias, std=cfg.init_method_std, device=device,
                                        dtype=dtype, row_blocks=(per_group * self.head_dim, self.head_dim,
                                                                 self.head_dim))
        self.qk_norm = QKNorm(cfg, ctx, device, dtype) if cfg.qk_layernorm else None
        self.proj = RowParallelLinear(self.heads * self.head_dim, cfg.hidden_size, ctx, bias=bias, std=out_std,
                                      device=device, dtype=dtype)
        self.core = AttentionCore(cfg, ctx, layer, device, dtype)

    def forward(self, x, freqs, documents=None):
        """`documents`: the microbatch's packed documents (engine/documents.py), or None."""
        q, k, v = split_qkv(self.qkv(x), self.groups // self.ctx.tp_size, self.heads // self.groups, self.head_dim)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if freqs is not None:
            q, k = dispatch.apply_rope(q, freqs), dispatch.apply_rope(k, freqs)
        return self.proj(self.core(q, k, v, documents, self.training))


class MLP(nn.Module):
    """fc2(act(fc1(x))), act SwiGLU or GELU. `fp8`: under FP8 training with SwiGLU and no biases, the three as one
    function keeping SwiGLU's tensors in FP8 (engine.fp8.attach gives it; engine.fp8.mlp), else None."""
    fp8 = None

    def __init__(self, cfg: ModelConfig, ctx, out_std, device, dtype, ffn: Optional[int] = None):
        super().__init__()
        ffn, bias = ffn or cfg.resolved_ffn_hidden_size(), not cfg.disable_bias_linear
        self.ctx = ctx
        self.swiglu, self.gelu_form = cfg.swiglu, "tanh" if cfg.openai_gelu else "none"
        self.swiglu_between_linears = cfg.swiglu and not bias
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, ffn, ctx, bias=bias, std=cfg.init_method_std,
                                        stack=2 if cfg.swiglu else 1, device=device, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx, bias=bias, std=out_std, device=device, dtype=dtype)

    def forward(self, x, positions=None):
        """`positions`: unused here (an MoE block routes by them; the two blocks take the same arguments)."""
        if self.fp8 is not None:  # the linears' own entry into and exit from the tensor-parallel region
            return self.fp8(x, self.fc1.weight, self.fc2.weight)
        y = self.fc1(x)
        y = dispatch.swiglu_stacked(y) if self.swiglu else F.gelu(y, approximate=self.gelu_form)
        return self.fc2(y)


def moe_block(cfg: ModelConfig, ctx, out_std, device, dtype, layer: int) -> MoELayer:
    """The MoE block of an MoE layer: routed experts, plus the shared expert as a tensor-parallel MLP."""
    shared = cfg.moe_shared_expert_intermediate_size
    shared = MLP(cfg, ctx, out_std, device, dtype, ffn=shared) if shared else None
    return MoELayer(cfg, ctx, out_std, device, dtype, shared=shared, layer_id=layer)


class TransformerLayer(nn.Module):
    """Attention then MLP, each a residual branch with its norm: norm1 the attention's, norm2 the MLP's, on the
    branch's input (--norm-placement pre) or on its output (post, OLMo-2: x + norm(f(x))). `layer`: its global id."""

    def __init__(self, cfg: ModelConfig, ctx, device, dtype, layer: int, moe: bool = False):
        super().__init__()
        self.ctx, self.dropout, self.post_norm = ctx, cfg.hidden_dropout, cfg.norm_placement == "post"
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        attention = LatentAttention if cfg.multi_latent_attention else Attention
        parts = {"norm1": Norm(cfg.hidden_size, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype),
                 "attention": attention(cfg, ctx, out_std, device, dtype, layer),
                 "norm2": Norm(cfg.hidden_size, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype),
                 "mlp": moe_block(cfg, ctx, out_std, device, dtype, layer) if moe else MLP(cfg, ctx, out_std, device,
                                                                                           dtype)}
        # Registered in the order forward uses them, the order the grad buffer lays parameters out in.
        for name in ("attention", "norm1", "mlp", "norm2") if self.post_norm else parts:
            setattr(self, name, parts[name])

    def _drop(self, x):
        if not self.training or self.dropout == 0.0:
            return x
        with self.ctx.residual_dropout_rng():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x, freqs, positions, documents=None):
        if self.post_norm:
            x = x + self._drop(self.norm1(self.attention(x, freqs, documents)))
            return x + self._drop(self.norm2(self.mlp(x, positions)))
        # The residual add before the MLP's norm is fused with it: one pass over the activations.
        h, x = self.norm2.add(self._drop(self.attention(self.norm1(x), freqs, documents)), x)
        return x + self._drop(self.mlp(h, positions))


class Unit(NamedTuple):
    """A piece of a model chunk that runs as a whole: the embedding, a layer or the head."""
    name: object          # "embedding", the layer's global id, or "head"
    module: nn.Module     # whose forward runs it
    params: list


class GPTModel(nn.Module):
    head_fp8 = None  # the output layer's FP8 GEMMs under --fp8-output-layer (engine.fp8.attach), else None

    def __init__(self, cfg: ModelConfig, ctx, *, layers: Optional[Sequence[int]] = None, pre_process: bool = True,
                 post_process: bool = True, vocab_size: Optional[int] = None, z_loss_weight: float = 0.0,
                 seed: int = 1234, device=None, dtype=None):
        super().__init__()
        self.cfg, self.ctx, self.z_loss_weight = cfg, ctx, z_loss_weight
        self.pre_process, self.post_process = pre_process, post_process
        self.aux_loss_scale = 1.0  # set_aux_loss_scale's
        self.vocab_size = vocab_size or cfg.vocab_size
        if not self.vocab_size:
            raise ValueError("GPTModel needs a vocabulary size (config vocab_size or the tokenizer's)")
        self.padded_vocab = padded_vocab_size(self.vocab_size, cfg.make_vocab_size_divisible_by, ctx.tp_size)
        self.layer_ids = list(range(cfg.num_layers) if layers is None else layers)
        h, std = cfg.hidden_size, cfg.init_method_std
        self.tied = not cfg.untie_embeddings_and_output_weights
        if pre_process:
            self.word = VocabParallelEmbedding(self.padded_vocab, self.vocab_size, h, ctx, std=std, device=device,
                                               dtype=dtype, init_key=WORD_EMBEDDING_KEY)
            if cfg.position_embedding_type == "learned_absolute":
                self.position = make_param((cfg.max_position_embeddings or cfg.seq_length, h), None, ctx,
                                           ("normal", std), device, dtype, sp_partial_grad=True)
        moe = set(cfg.routed_layers())
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ctx, device, dtype, i, moe=i in moe)
                                     for i in self.layer_ids})
        self.mtp = None
        if post_process and cfg.mtp_num_layers:
            self.mtp = nn.ModuleList([MTPModule(cfg, ctx, TransformerLayer(cfg, ctx, device, dtype, i, moe=i in moe),
                                                device, dtype) for i in cfg.mtp_layers()])
            self.reset_mtp_measured()
        if post_process:
            self.final_norm = Norm(h, ctx, cfg.normalization, cfg.norm_epsilon, device, dtype)
            if not self.tied:
                self.output = make_param((self.padded_vocab, h), 0, ctx, ("normal", std), device, dtype,
                                         valid_rows=self.vocab_size)
            elif not pre_process:
                # The last stage's copy of the tied embedding: drawn from the same stream, kept in sync by
                # all-reducing its gradient with the first stage's.
                self.output = make_param((self.padded_vocab, h), 0, ctx, ("normal", std), device, dtype,
                                         init_key=WORD_EMBEDDING_KEY, valid_rows=self.vocab_size,
                                         copy_of=TIED_EMBEDDING)
            if self.mtp is not None and not self.tied and not pre_process:  # MTP's copy of the embedding
                self.mtp_embedding = make_param((self.padded_vocab, h), 0, ctx, ("normal", std), device, dtype,
                                                init_key=WORD_EMBEDDING_KEY, valid_rows=self.vocab_size,
                                                copy_of=TIED_EMBEDDING)
        if (self.tied or cfg.mtp_num_layers) and ctx.pp_size > 1:
            for p in self._output_weight_candidates():
                mark_tied(p)
        recompute_layers = cfg.recompute_num_layers if cfg.recompute_num_layers is not None else len(self.layer_ids)
        self.full_recompute = set(self.layer_ids[:recompute_layers]) if cfg.recompute_granularity == "full" else set()
        if device is None or torch.device(device).type != "meta":
            init_weights(self, ctx, seed)

    def _output_weight_candidates(self):
        """The parameters kept equal across the first and last stage: the word embedding and its copy there."""
        if self.pre_process:
            yield self.word.weight
        if self.post_process and not self.pre_process:
            if self.tied:
                yield self.output
            elif self.mtp is not None:
                yield self.mtp_embedding

    def set_aux_loss_scale(self, scale: float) -> None:
        """What the auxiliary losses' gradients (MoE balancing and z losses, MTP's) are multiplied by in backward:
        the LM loss's 1/microbatches x loss scale. The pipeline runner sets it for each step it runs; a model
        called directly keeps 1."""
        self.aux_loss_scale = float(scale)
        for module in self.modules():
            if isinstance(module, MoELayer):
                module.aux_loss_scale = self.aux_loss_scale

    def output_weight(self):
        return self.word.weight if self.tied and self.pre_process else self.output

    def units(self) -> list:
        """This chunk's pieces in forward order: the embedding (word and learned position embeddings, run by
        the chunk's own forward), each layer, the head (final norm and output weight, which at pp 1 with tied
        embeddings is the word embedding again). ZeRO-3 gathers them one at a time (engine.optim.param_shard)
        and the MoE statistics find the routed layers among them (engine.moe.stats)."""
        units = []
        if self.pre_process:
            units.append(Unit("embedding", self, [self.word.weight] + ([self.position] if hasattr(self, "position")
                                                                        else [])))
        units += [Unit(i, self.layers[str(i)], list(self.layers[str(i)].parameters())) for i in self.layer_ids]
        if self.post_process:
            # MTP's modules run after the main head, with the embedding and the output weight: one unit with it
            mtp = [] if self.mtp is None else list(self.mtp.parameters()) + [self.mtp_embedding_weight()]
            params = list(self.final_norm.parameters()) + [self.output_weight()]
            units.append(Unit("head", self.final_norm, params + [p for p in mtp if all(p is not q for q in params)]))
        return units

    def mtp_embedding_weight(self):
        """The word embedding MTP reads: the first stage's own, else the last stage's copy."""
        if self.pre_process:
            return self.word.weight
        return self.output if self.tied else self.mtp_embedding

    def mtp_embed(self, tokens):
        return vocab_parallel_lookup(tokens, self.mtp_embedding_weight(), self.ctx)

    def reset_mtp_measured(self) -> None:
        """(each MTP module's losses summed over the step's microbatches, microbatches) for engine.mtp.MTPStats."""
        self.mtp_measured = (torch.zeros(len(self.mtp), dtype=torch.float64), 0)

    def rope_freqs(self, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """RoPE angles of the given position ids (this rank's, under CP): [s, d/2] of ids [s] shared by the samples,
        [s, b, d/2] (s-major, as the activations) of each sample's own ids [b, s]."""
        if self.cfg.position_embedding_type != "rope":
            return None
        inv = inverse_frequencies(self.cfg, position_ids.device)
        return position_ids.t().to(torch.float32).unsqueeze(-1) * inv

    def embed(self, tokens, position_ids):
        """Embeddings of `tokens` [b, s] at `position_ids` ([s], or [b, s] each sample's own)."""
        x = self.word(tokens)
        if self.cfg.position_embedding_type == "learned_absolute":
            table = self.position[position_ids.t()]  # [s, h] or [s, b, h]
            x = x + self.ctx.local_seq(table.view(table.shape[0], -1, table.shape[-1]))
        if self.training and self.cfg.hidden_dropout:
            with self.ctx.residual_dropout_rng():
                x = F.dropout(x, self.cfg.hidden_dropout, training=True)
        return x

    def forward(self, tokens=None, hidden=None, labels=None, positions=None, position_ids=None, documents=None,
                mtp=None):
        """`positions` [s]: where in the sequence the tokens (or the activations `hidden`) are, by index; by default
        all of one whole sequence, 0..s-1. `position_ids`: what RoPE and the learned table read (default
        `positions`), or [b, s] each sample's own. `documents`: the microbatch's packed documents, or None. `mtp`:
        this rank's part of the microbatch's multi-token prediction targets (engine.mtp.targets), or None."""
        if positions is None:
            s = tokens.shape[1] if tokens is not None else hidden.shape[0] * self.ctx.seq_split
            positions = torch.arange(s, device=(tokens if tokens is not None else hidden).device)
        ids = positions if position_ids is None else position_ids
        x = self.embed(tokens, ids) if self.pre_process else hidden
        freqs = self.rope_freqs(ids)
        for i in self.layer_ids:
            layer = self.layers[str(i)]
            if i in self.full_recompute and self.training:
                # positions and documents ride in the replayed call, not among the saved tensors
                x = recompute(functools.partial(layer, positions=positions, documents=documents), self.ctx.rng, x,
                              freqs)
            else:
                x = layer(x, freqs, positions, documents)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        out = self.head(x, labels)
        if self.mtp is None or mtp is None or labels is None:
            return out
        losses = module_losses(self, x, mtp, freqs, positions, documents)
        if self.training and torch.is_grad_enabled():
            sums, microbatches = self.mtp_measured
            self.mtp_measured = (sums + losses.detach().double().cpu(), microbatches + 1)
        return with_aux_loss(out, losses.sum() * (self.cfg.mtp_loss_scaling_factor / len(self.mtp)),
                             self.aux_loss_scale)

    def head(self, x, labels):
        """This rank's vocabulary slice of the logits [b, s, V/tp], or with labels every token's loss [b, s]. Its
        GEMMs run in FP8 under --fp8-output-layer (`head_fp8`, engine.fp8.attach gives it)."""
        if self.head_fp8 is not None:
            logits = self.head_fp8.enter(x, self.output_weight())
        else:
            logits = mappings.enter_tp_linear(x, self.output_weight(), None, self.ctx)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)
        s, b, v = logits.shape
        return vocab_parallel_cross_entropy(logits.reshape(s * b, v), labels.t().reshape(-1), self.ctx,
                                            self.vocab_size, self.z_loss_weight).view(s, b).t()


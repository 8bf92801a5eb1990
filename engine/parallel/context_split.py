"""Which positions of a sequence a context-parallel rank holds: the load-balanced causal layout.

The sequence is cut into 2 x cp equal chunks and CP rank r holds chunks r and 2cp - 1 - r. Under causal
attention a query chunk attends to every chunk up to its own, so chunk i costs i + 1/2 chunk-pairs; the
pair (r, 2cp - 1 - r) costs 2cp for every r, and each rank does the same work (the plain split, chunk r
of cp, would leave the last rank cp times the work of the first). Tokens, labels, the loss mask, position
ids and RoPE angles are all cut by `split`, so a rank's activations are its two chunks, in this order.

`shard_batch` is the door of the pipeline runner: it reads the whole microbatch once, packed documents included
(engine/documents.py: their bounds, and the position ids that restart with each, from the whole sequence's
tokens, since a document may cross chunks), and gives this rank its part. The documents stay whole: they are
read at absolute positions (the attention mask, the kernels, the ring's plan), like the positions themselves.
With packed documents the causal balance holds only on average: each query's work is its document's keys
before it, so a rank's share depends on where documents begin (docs/guide.md: context parallelism).
"""
from __future__ import annotations

import torch

from engine.documents import Packing


def chunk_ids(cp: int, cp_rank: int) -> tuple:
    """The two chunks (of 2 x cp) CP rank `cp_rank` holds, in the order its activations keep them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def split(t: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of `t` along its sequence dimension `dim` (t itself when cp is 1)."""
    if cp == 1:
        return t
    size = t.shape[dim] // (2 * cp)
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat((t.narrow(dim, first * size, size), t.narrow(dim, second * size, size)), dim=dim)


def positions(seq_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions (0-based token indices of the whole sequence) this CP rank holds, in its order."""
    return split(torch.arange(seq_length, device=device), 0, cp, cp_rank)


# [b, s] tensors of a microbatch, and multi-token prediction's [b, s, D] (engine.mtp.KEYS), cut along the sequence
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "mtp_tokens", "mtp_labels", "mtp_mask")


def shard_batch(batch: dict, ctx, packing: Packing = Packing()) -> dict:
    """This CP rank's part of a microbatch of whole sequences: its tokens, labels and loss mask, their `positions`
    in the whole sequence (the tokens' indices: the MoE routing order and the mask read them), their
    `position_ids` (the positions, or [b, s/cp] each sample's own under --reset-position-ids) and the
    microbatch's `documents` (under --reset-attention-mask, else None). Every rank of a pipeline gets them, also
    those that read no tokens."""
    tokens = batch["tokens"]
    mine = {k: split(batch[k], 1, ctx.cp_size, ctx.cp_rank) for k in SEQUENCE_KEYS if batch.get(k) is not None}
    where = positions(tokens.shape[1], ctx.cp_size, ctx.cp_rank, tokens.device)
    ids, documents = packing.apply(tokens)
    ids = where if ids is None else split(ids, 1, ctx.cp_size, ctx.cp_rank)
    return dict(mine, positions=where, position_ids=ids, documents=documents)

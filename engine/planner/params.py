"""The model's parameters as the planner counts them (no model is built): one inventory of the tensors
engine/model.py builds, what each costs in bytes, and the counts per pipeline rank derived from it.

The inventory lists each tensor once, in engine/model.py's order, as one tensor- and expert-parallel rank
holds it: the embedding [V_pad, h] split over tp (and learned positions [max_pos, h] replicated); per layer two
norms (replicated), fused QKV and fc1 column-parallel (rows and bias split), attention output and fc2
row-parallel (columns split, bias whole); a final norm and the output layer [V_pad, h] on the last stage (when
the embedding is tied and pp > 1, the last stage holds its own copy of the embedding). The matrices' whole
shapes come from engine/flops.py, which counts the FLOPs of the same matrices. With --qk-layernorm the
attention also holds q's and k's norms (engine/parallel/qk_norm.py): per head, two replicated norms of
head_dim; over the whole projection, weights of heads x head_dim and groups x head_dim split over tp. With
--norm-placement post each norm follows its sublayer, in the order as in forward.

Mixture of experts (engine/moe, engine/model.py `moe_block`): an MoE layer keeps the norms and attention of a
dense one; its router [E, h] is replicated (and an fp32 expert bias [E], not trained), its routed experts fc1
[E, h, 2F or F] and fc2 [E, F, h] are split over the ep ranks (E/ep each) and replicated over tp, and its
shared expert is a tensor-parallel MLP. Expert gradients reduce, and the distributed optimizer shards their
state, over the dp/ep x cp ranks holding the same experts; dense parameters over dp x cp.

Two readers: engine/planner/memory.py counts a rank's parameters (`param_split_per_rank`), and
engine/planner/sharding.py replays the grad buffer's bucket layout on a chunk's tensors in forward order
(`chunk_tensors`).
"""
from __future__ import annotations

from typing import NamedTuple

from engine.config import ModelConfig
from engine.flops import attention_matrices, attention_splits, latent_norm_sizes, mlp_matrices
from engine.layout import Layout
from engine.planner.stages import end_ranks, moe_layers_per_rank, stage_layer_counts

# Bytes per parameter, as engine/optim allocates them: 2-byte weights in bf16/fp16, an fp32 main-grad
# buffer (microbatch gradients accumulate in fp32), Adam m and v in fp32, and an fp32 master copy
# whenever the weights are not fp32 or the state is sharded (a shard cannot alias the weights).
# Mixed precision thus costs 18 B/param, or 6 + 12/dp with the distributed optimizer, as in
# Megatron-LM's distributed-optimizer guide.
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4
ADAM_MOMENT_BYTES = 8
MASTER_BYTES = 4
# --optimizer muon: the hidden layers' weights (linear weights and routed experts, the tags below; the
# engine's ParamSpec.matrix) keep one fp32 momentum instead of Adam's two moments (engine/optim/muon.py)
MUON_MOMENTUM_BYTES = 4
MUON_TAGS = ("weight", "experts")


class Tensor(NamedTuple):
    """One parameter tensor as one tensor- and expert-parallel rank holds it (the planner reads only counts,
    so the shape is kept as its element count)."""
    numel: int
    tag: str               # what it is; the bucket replay reads "norm_w"/"norm_b" (arrival order) and "word"
    expert: bool = False   # a routed expert's: E/ep per ep rank, whole on every tp rank, its own grad buffer
    trained: bool = True   # False: the router's fp32 expert bias (no gradient, no optimizer state)
    tied: bool = False     # the tied embedding or its last-stage copy at pp > 1: gradients summed across stages
    fp8: bool = False      # an FP8 layer's weight, which --fp8-param-gather gathers as codes: a column- or
    #                        row-parallel linear's (engine/fp8 gives it an Fp8Linear) or routed experts' (Fp8Experts)


def tensor_parallel(axis) -> bool:
    """Whether an attention matrix split along `axis` (engine.flops.attention_splits: 0 its rows, 1 its columns,
    None replicated) is a column- or row-parallel linear. Those are the FP8 ones (engine.fp8.attach); MLA's
    replicated latent down-projections, like MTP's projection, stay in the run's precision."""
    return axis is not None


def _linear(matrix: tuple, tp: int, column: bool, bias: bool) -> list:
    """A tensor-parallel linear's weight and bias: column-parallel splits the rows (and the bias), row-parallel
    the columns (its bias whole)."""
    rows, cols = matrix
    bias_numel = rows // tp if column else rows
    return [Tensor(rows * cols // tp, "weight", fp8=True)] + ([Tensor(bias_numel, "bias")] if bias else [])


def _latent_attention(model: ModelConfig, tp: int) -> list:
    """MLA's projections in forward order, each latent's norm after its down-projection (replicated, as the
    down-projections are)."""
    norms = list(latent_norm_sizes(model))
    out = []
    for matrix, axis in zip(attention_matrices(model), attention_splits(model)):
        if tensor_parallel(axis):
            out += _linear(matrix, tp, axis == 0, False)
            continue
        out += [Tensor(matrix[0] * matrix[1], "weight")]
        if norms:
            out += _norm(model, norms.pop(0))
    return out


def _mlp(model: ModelConfig, ffn: int, tp: int) -> list:
    """A tensor-parallel MLP of width ffn: fc1 column-parallel, fc2 row-parallel."""
    fc1, fc2 = mlp_matrices(model, ffn)
    bias = not model.disable_bias_linear
    return _linear(fc1, tp, True, bias) + _linear(fc2, tp, False, bias)


def _norm(model: ModelConfig, size: int = 0) -> list:
    """A norm's weight and, for LayerNorm, bias (replicated), over `size` channels (default the hidden size)."""
    h = size or model.hidden_size
    return [Tensor(h, "norm_w")] + ([Tensor(h, "norm_b")] if model.normalization == "LayerNorm" else [])


def _qk_norm(model: ModelConfig, tp: int) -> list:
    """q's and k's norms (--qk-layernorm): per head, two norms of head_dim; over the whole projection, the
    RMSNorm weights of q's and of k's rows, split over tp like them."""
    if not model.qk_layernorm:
        return []
    d = model.head_dim()
    if model.qk_layernorm_scope == "head":
        return _norm(model, d) + _norm(model, d)
    return [Tensor(n * d // tp, "norm_w") for n in (model.num_attention_heads, model.resolved_query_groups())]


def _moe_block(model: ModelConfig, tp: int, ep: int) -> list:
    """Router weight and fp32 expert bias, this ep rank's E/ep routed experts (fc1 and fc2 stacked over the
    experts, engine/moe/experts.py), and the shared expert."""
    E, h, shared = model.num_experts, model.hidden_size, model.moe_shared_expert_intermediate_size
    router = [Tensor(E * h, "router")]
    if model.moe_router_enable_expert_bias:
        router.append(Tensor(E, "expert_bias", trained=False))
    experts = [Tensor(E // ep * rows * cols, "experts", expert=True, fp8=True)
               for rows, cols in mlp_matrices(model, model.resolved_moe_ffn_hidden_size())]
    return router + experts + (_mlp(model, shared, tp) if shared else [])


def layer_tensors(model: ModelConfig, tp: int, ep: int = 1, moe: bool = False) -> list:
    """One transformer layer's tensors on one (tp, ep) rank, in engine/model.py's order: norm1, QKV (its q and k
    norms), output projection, norm2, then the MLP or (`moe`) the MoE block; each norm after its sublayer
    under --norm-placement post."""
    bias = not model.disable_bias_linear
    if model.multi_latent_attention:
        attention = _latent_attention(model, tp)
    else:
        qkv, proj = attention_matrices(model)
        attention = (_linear(qkv, tp, True, bias or model.add_qkv_bias) + _qk_norm(model, tp)
                     + _linear(proj, tp, False, bias))
    mlp = _moe_block(model, tp, ep) if moe else _mlp(model, model.resolved_ffn_hidden_size(), tp)
    if model.norm_placement == "post":
        return attention + _norm(model) + mlp + _norm(model)
    return _norm(model) + attention + _norm(model) + mlp


def embedding_tensors(model: ModelConfig, tp: int, pp: int) -> list:
    """The first stage's: the word embedding and, with learned positions, their table."""
    h, tied = model.hidden_size, not model.untie_embeddings_and_output_weights or bool(model.mtp_num_layers)
    out = [Tensor(model.padded_vocab_size(tp) * h // tp, "word", tied=tied and pp > 1)]  # (the last stage's copy)
    if model.position_embedding_type == "learned_absolute":
        out.append(Tensor((model.max_position_embeddings or model.seq_length) * h, "position"))
    return out


def head_tensors(model: ModelConfig, tp: int, pp: int, ep: int = 1) -> list:
    """The last stage's: the final norm and the output layer, or with a tied embedding at pp > 1 its copy (at
    pp 1 the embedding itself serves; validation keeps pp 1 to one chunk); then the MTP modules (engine/mtp.py:
    two norms, the replicated 2h -> h projection, a layer like the decoder's last, a final norm), and at pp > 1
    with an untied embedding MTP's copy of it."""
    tied = not model.untie_embeddings_and_output_weights
    vocab = model.padded_vocab_size(tp) * model.hidden_size // tp
    out = _norm(model) + ([] if tied and pp == 1 else [Tensor(vocab, "output", tied=tied)])
    moe = model.num_layers - 1 in model.moe_layers()
    for _ in model.mtp_layers():
        out += (_norm(model) + _norm(model) + [Tensor(2 * model.hidden_size ** 2, "weight")]
                + layer_tensors(model, tp, ep, moe) + _norm(model))
    if model.mtp_num_layers and not tied and pp > 1:
        out.append(Tensor(vocab, "word", tied=True))
    return out


def chunk_tensors(model: ModelConfig, tp: int, ep: int, kinds: tuple, pre: bool, post: bool, pp: int) -> list:
    """(unit, Tensor) of one model chunk in forward order (engine.optim.param_shard.forward_order): the
    embedding's when it holds the first stage (`pre`), its layers (`kinds`: True for an MoE layer), the head's
    when it holds the last (`post`). `unit` is the gathered unit (GPTModel.units) the grad buffer files the
    tensor under: "embedding", the layer's index in the chunk, "head"; the word embedding at pp 1 when the head
    reads it too (tied, or MTP's embedding), under the head (the last unit holding it)."""
    word_unit = "head" if post and (not model.untie_embeddings_and_output_weights or model.mtp_num_layers) \
        else "embedding"
    out = []
    if pre:
        out += [(word_unit if t.tag == "word" else "embedding", t) for t in embedding_tensors(model, tp, pp)]
    for i, moe in enumerate(kinds):
        out += [(i, t) for t in layer_tensors(model, tp, ep, moe)]
    if post:
        out += [("head", t) for t in head_tensors(model, tp, pp, ep)]
    return out


def _split(tensors: list, muon: bool = False) -> tuple:
    """(dense trained, expert, frozen) elements of `tensors` (`muon`: of those Muon takes)."""
    tensors = [t for t in tensors if t.tag in MUON_TAGS] if muon else tensors
    return (sum(t.numel for t in tensors if t.trained and not t.expert), sum(t.numel for t in tensors if t.expert),
            sum(t.numel for t in tensors if not t.trained))


def param_split_per_rank(model: ModelConfig, layout: Layout, muon: bool = False) -> list:
    """(dense, experts, frozen) parameters held by each pipeline rank (any tp and ep rank: equal counts): dense
    ones reduce over dp x cp, the routed experts' over dp/ep x cp, frozen ones (the fp32 expert bias) have no
    gradient or optimizer state. Dense models have (n, 0, 0). `muon`: only the weights Muon takes."""
    tp, ep = layout.tp, layout.ep
    dense = _split(layer_tensors(model, tp), muon)[0]
    moe = _split(layer_tensors(model, tp, ep, True), muon) if model.num_experts else (0, 0, 0)
    embedding = _split(embedding_tensors(model, tp, layout.pp), muon)[0]
    head = _split(head_tensors(model, tp, layout.pp, ep), muon)
    n_moe = moe_layers_per_rank(model, layout)
    first, last = end_ranks(layout)
    out = []
    for r, chunks in enumerate(stage_layer_counts(model.num_layers, layout)):
        n = (sum(chunks) - n_moe[r]) * dense + n_moe[r] * moe[0]
        n += (embedding if r == first else 0) + (head[0] if r == last else 0)
        out.append((n, n_moe[r] * moe[1] + (head[1] if r == last else 0), n_moe[r] * moe[2] + (head[2] if r == last
                                                                                             else 0)))
    return out


def params_per_rank(model: ModelConfig, layout: Layout) -> list:
    """Parameters held by each pipeline rank (any tensor- or expert-parallel rank: they hold equal counts)."""
    return [sum(split) for split in param_split_per_rank(model, layout)]

"""FLOPs of a training iteration, GPU presets, and model FLOPs utilization (MFU).

The count is the one used by the Megatron papers (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", eq. 3; Korthikanti et al. 2022, sec. 6), generalised to
grouped-query attention, SwiGLU and untied heads: every matrix multiply costs 2 FLOPs per
multiply-add, the backward pass costs twice the forward, and for a GPT-3-shaped model

    model FLOPs = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).

Causal-attention convention: attention scores and attention-times-values are counted over the FULL
s×s matrix (4·b·s²·h forward FLOPs per layer), not half of it for the causal mask. This is the
convention of the published numbers the layout planner is checked against (Megatron papers, PaLM's
MFU appendix); the trainer's MFU log line and the planner both use this module, so they agree.
A sliding-window layer counts each query against the L + 1 keys of its window instead of s
(engine/attention_mask.py states the convention; Megatron-LM's own count ignores windows). Packed documents
under --reset-attention-mask count each query against its own document: the sum of L_i^2 over a sample's
documents instead of s^2 (`attention_pairs`), from the documents the step actually held (the pipeline runner
counts them) or, in the planner, from a mean document length.

Mixture of experts: a token goes through its top-k routed experts, the shared expert and the router
(2·h·E) of an MoE layer, so its FLOPs count the *activated* parameters (Mixtral 8x7B: ~12.9B of 46.7B),
not all of them; dense layers count as above. Token dropping (a capacity factor) is not subtracted.

"Model FLOPs" never include recomputation; "hardware FLOPs" add the recomputed forward work
(full recomputation: the whole transformer forward again, giving Narayanan's
96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)); selective: the attention core forward again).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from engine.attention_mask import AttentionMask
from engine.config import ModelConfig


class Costs(NamedTuple):
    """Time of one stage's forward, input-gradient backward (B) and weight-gradient backward (W) of one
    microbatch, in any unit (only their ratios matter): what a zero-bubble order is built for
    (engine.pipeline.zero_bubble)."""
    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0


UNIT = Costs()


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and the links around it, as a DGX/HGX-class node provides them.

    peak_tflops: dense bf16 tensor-core peak (no sparsity). memory_gib: memory the device reports.
    hbm_tbps: memory bandwidth, TB/s. nvlink_gbps / network_gbps: per-GPU bandwidth in Gbit/s, one
    direction, inside a node and to other nodes (one NIC per GPU, as in DGX systems).
    """
    name: str
    peak_tflops: float
    memory_gib: float
    hbm_tbps: float
    nvlink_gbps: float
    network_gbps: float


# Sources: NVIDIA data sheets (A100 Tensor Core GPU, 2021; H100, 2023; H200, 2024; HGX B200, 2024)
# for peak dense bf16, memory and HBM bandwidth; NVLink 3/4/5 = 600/900/1800 GB/s both directions
# per GPU (so 2400/3600/7200 Gbit/s one way); DGX A100 has 8x 200 Gb/s HDR NICs, DGX H100/H200/B200
# 8x 400 Gb/s NDR. H100 PCIe has no NVSwitch: GPUs talk over PCIe Gen5 x16 (64 GB/s one way).
# Memory is what the device reports in GiB (e.g. 81559 MiB for H100 80GB).
GPU_PRESETS = {
    "a100-40g": GPUSpec("a100-40g", 312.0, 40.0, 1.555, 2400.0, 200.0),
    "a100-80g": GPUSpec("a100-80g", 312.0, 80.0, 2.039, 2400.0, 200.0),
    "h100-sxm": GPUSpec("h100-sxm", 989.0, 79.6, 3.35, 3600.0, 400.0),
    "h100-pcie": GPUSpec("h100-pcie", 756.0, 79.6, 2.0, 512.0, 400.0),
    "h200": GPUSpec("h200", 989.0, 140.4, 4.8, 3600.0, 400.0),
    "b200": GPUSpec("b200", 2250.0, 179.0, 8.0, 7200.0, 400.0),
}

# torch.cuda.get_device_name() substrings -> preset, most specific first.
_DEVICE_NAMES = (
    ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"), ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40g"), ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"),
)


def detect_gpu(device_name: str) -> Optional[GPUSpec]:
    """The preset for a CUDA device name such as 'NVIDIA H100 80GB HBM3', or None if unknown."""
    for needle, key in _DEVICE_NAMES:
        if needle.lower() in device_name.lower():
            return GPU_PRESETS[key]
    return None


def attention_matrices(model: ModelConfig) -> tuple:
    """(rows, columns) of an attention block's weight matrices, whole (no tp split), in forward order: the fused
    QKV (column-parallel in the engine) and the output projection (row-parallel); under multi-head latent
    attention (engine/latent_attention.py) q's down- and up-projection (or q's one projection), kv's down- and
    up-projection and the output projection. The planner's parameter inventory (engine/planner/params.py) builds
    its tensors from these, and `attention_splits` says how tp splits each, so a layer's shapes are written once."""
    h, nq = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        qk, pos, v, q_rank = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim, model.q_lora_rank
        q = ((q_rank, h), (nq * (qk + pos), q_rank)) if q_rank else ((nq * (qk + pos), h),)
        return q + ((model.kv_lora_rank + pos, h), (nq * (qk + v), model.kv_lora_rank), (h, nq * v))
    d, nkv = model.head_dim(), model.resolved_query_groups()
    return ((nq + 2 * nkv) * d, h), (h, nq * d)


def attention_splits(model: ModelConfig) -> tuple:
    """The axis tp splits each of `attention_matrices` along: 0 (rows: column-parallel), 1 (columns: row-parallel)
    or None (replicated: MLA's down-projections to its latents)."""
    if model.multi_latent_attention:
        return ((None, 0) if model.q_lora_rank else (0,)) + (None, 0, 1)
    return 0, 1


def latent_norm_sizes(model: ModelConfig) -> tuple:
    """Channels of MLA's latent norms (--qk-layernorm under --multi-latent-attention): q's (with a q latent), kv's."""
    if not (model.multi_latent_attention and model.qk_layernorm):
        return ()
    return ((model.q_lora_rank,) if model.q_lora_rank else ()) + (model.kv_lora_rank,)


def qk_channels(model: ModelConfig) -> tuple:
    """(q/k channels, v channels) of one head: MLA's qk_head_dim + qk_pos_emb_head_dim and v_head_dim."""
    if model.multi_latent_attention:
        return model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    return model.head_dim(), model.head_dim()


def mlp_matrices(model: ModelConfig, ffn: int) -> tuple:
    """(rows, columns) of an MLP's two weight matrices of width `ffn`, whole: fc1 (gate and up stacked with
    SwiGLU; column-parallel) and fc2 (row-parallel)."""
    h = model.hidden_size
    return ((2 if model.swiglu else 1) * ffn, h), (h, ffn)


def _elements(matrices: tuple) -> int:
    return sum(rows * cols for rows, cols in matrices)


def layer_matmul_params(model: ModelConfig, moe: bool = False) -> int:
    """Weights one token multiplies by in one layer: QKV, attention output and the MLP (fc1, fc2); in an MoE
    layer (`moe`) the MLP is its top-k routed experts, the shared expert and the router instead."""
    attention = _elements(attention_matrices(model))
    if not moe:
        return attention + _elements(mlp_matrices(model, model.resolved_ffn_hidden_size()))
    routed = model.moe_router_topk * _elements(mlp_matrices(model, model.resolved_moe_ffn_hidden_size()))
    shared = _elements(mlp_matrices(model, model.moe_shared_expert_intermediate_size or 0))
    return attention + routed + shared + model.hidden_size * model.num_experts


def activated_params(model: ModelConfig, embedding: bool = True) -> int:
    """Parameters one token uses: per layer the matrices of `layer_matmul_params` and the two norms, plus
    the final norm, the output layer and, with `embedding`, the whole input embedding (once when tied; biases left
    out). Published "active parameter" figures differ on the embedding, a lookup of one row per token: Mixtral
    8x7B's 12.9B counts it (Jiang et al. 2024, arXiv:2401.04088); DeepSeek's figures, two significant digits, lie
    on the side that leaves it out (V2: 20.85B without, 21.38B with, published 21B, arXiv:2405.04434; V3: 36.63B
    without, 37.55B with, published 37B, arXiv:2412.19437, its multi-token prediction module not counted)."""
    h, moe = model.hidden_size, set(model.moe_layers())
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    latent_norms = sum(latent_norm_sizes(model))
    layers = sum(layer_matmul_params(model, i in moe) + 2 * norm + latent_norms for i in range(model.num_layers))
    tables = 2 if model.untie_embeddings_and_output_weights else 1
    embeddings = model.padded_vocab_size() * h * (tables if embedding else tables - 1)
    return layers + norm + embeddings


def attention_pairs(model: ModelConfig, lengths: Sequence[int]) -> int:
    """Query-key pairs the count gives one sample whose documents have these lengths, summed over the layers
    (engine/attention_mask.py's convention: sum of L_i^2, or L_i times the window where shorter); [s] for a
    sample that is one sequence."""
    return sum(AttentionMask.of(model, i).counted_pairs(lengths) for i in range(model.num_layers))


def attention_flops(model: ModelConfig, pairs: int) -> int:
    """Forward FLOPs of the attention cores over `pairs` query-key pairs (QK^T over the q/k channels and PV over
    the value channels: 2 per channel each)."""
    qk, v = qk_channels(model)
    return 2 * pairs * model.num_attention_heads * (qk + v)


def forward_flops_per_sequence(model: ModelConfig, seq_length: int, tp: int = 1) -> dict:
    """Forward FLOPs of one sequence, split into the parts recomputation treats differently."""
    heads = 1 + (model.mtp_num_layers or 0)  # the output layer, again after each MTP module
    logits = 2 * seq_length * model.hidden_size * model.padded_vocab_size(tp) * heads
    return {**_layer_flops(model, seq_length), "logits": logits}


def _layer_flops(model: ModelConfig, s: int) -> dict:
    """Forward FLOPs of all transformer layers for one sequence, the MTP modules' (engine/mtp.py: a layer like the
    last one, and the 2h -> h projection) included: their matrix multiplies and attention cores."""
    l, n_moe, n_mtp = model.num_layers, len(model.moe_layers()), model.mtp_num_layers or 0
    dense, moe = layer_matmul_params(model), layer_matmul_params(model, moe=True) if n_moe else 0
    matmul = (l - n_moe) * dense + n_moe * moe
    pairs = attention_pairs(model, [s])
    if n_mtp:
        last_moe = l - 1 in model.moe_layers()
        matmul += n_mtp * ((moe if last_moe else dense) + 2 * model.hidden_size ** 2)
        pairs += n_mtp * AttentionMask.of(model, l - 1).counted_pairs([s])
    return {"linear": 2 * s * matmul, "attention": attention_flops(model, pairs)}


def split_backward_costs(model: ModelConfig, seq_length: int, recompute: Optional[str] = None) -> Costs:
    """A layer's forward, input-gradient backward (B) and weight-gradient backward (W) in FLOPs, averaged over
    the layers: the costs a zero-bubble order is built for (engine.pipeline.zero_bubble).

    Every matrix multiply's input gradient and weight gradient each cost its forward. W holds the weight
    gradients engine.parallel.mappings defers: the attention projections', the dense MLPs' and the shared
    experts'; the routed experts compute theirs in B. The attention core has no weights, so all of its
    backward (twice its forward) is in B, and so is recomputation: the whole forward again with "full", the
    attention core with "selective". Embedding and loss are left out (a stage's costs are a layer's times its
    layer count)."""
    n_moe = len(model.moe_layers())
    shared = _elements(mlp_matrices(model, model.moe_shared_expert_intermediate_size or 0))
    dense = _elements(mlp_matrices(model, model.resolved_ffn_hidden_size()))
    attention = _elements(attention_matrices(model))
    deferred = model.num_layers * attention + n_moe * shared + (model.num_layers - n_moe) * dense
    f = _layer_flops(model, seq_length)
    forward = f["linear"] + f["attention"]
    weight = 2 * seq_length * deferred
    recomputed = forward if recompute == "full" else f["attention"] if recompute == "selective" else 0
    return Costs(float(forward), float(2 * f["linear"] - weight + 2 * f["attention"] + recomputed), float(weight))


def flops_per_iteration(model: ModelConfig, global_batch_size: int, seq_length: int,
                        recompute: Optional[str] = None, tp: int = 1, pairs: Optional[int] = None) -> float:
    """FLOPs of one training iteration over all GPUs.

    recompute None gives model FLOPs (for MFU); "selective" or "full" adds the recomputed forward
    work (hardware FLOPs, what the GPUs actually execute). `pairs`: the iteration's attention pairs summed
    over its samples and layers (packed documents: `attention_pairs` of each sample's documents), where
    they are not each sample's whole sequence.
    """
    f = forward_flops_per_sequence(model, seq_length, tp)
    attention = f["attention"] * global_batch_size if pairs is None else attention_flops(model, pairs)
    total = 3 * ((f["linear"] + f["logits"]) * global_batch_size + attention)
    if recompute == "full":
        total += f["linear"] * global_batch_size + attention
    elif recompute == "selective":
        total += attention
    return float(total)


def tflops_per_gpu(flops: float, seconds: float, num_gpus: int) -> float:
    return flops / seconds / num_gpus / 1e12


def mfu(flops: float, seconds: float, num_gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s per GPU over the device's dense bf16 peak."""
    return tflops_per_gpu(flops, seconds, num_gpus) / peak_tflops

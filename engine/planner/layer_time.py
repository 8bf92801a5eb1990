"""Seconds of one layer, the embedding and the output layer for one microbatch on one GPU: the per-layer half
of the step-time model (engine/planner/step_time.py puts the stages, the bubble and data parallelism around it).

A layer sums: the matrix multiplies at a fraction of peak that grows with the per-GPU matrix sizes (and
differs by GPU generation), the attention core, memory-bound element-wise work, the tensor-parallel
collectives over NVLink (less the share a TP-overlapping engine hides), and with context parallelism the part
of the K/V exchange the attention does not hide; beside the layers, the pipeline point-to-point sends, the
embedding and the output layer. Under cp every rank holds s/cp tokens of each sequence. With FP8 (Software.fp8)
the hidden linears' GEMMs run at FP8_GEMM_SPEEDUP times the bf16 rate where the engine uses FP8 tensor cores,
and their operands' casts add memory traffic. Every constant is
named below with where it comes from; the ones marked "fitted" were fitted to the held-in published runs of
engine/planner/published.py (listed with their errors in tests/test_planner_calibration.py). Compute is
costed at the tensor-core (bf16) peak whatever the precision; fp32 changes only the bytes.

Mixture of experts: an MoE layer replaces the MLP GEMMs by its router (fp32), its shared expert (a
tensor-parallel MLP) and its routed experts. Routing is taken as balanced: of the k x T assignments each
of the ep ranks of an EP group makes (T tokens per rank: s/(cp·tp) x b under sequence parallelism), every
expert gets k·T·ep/E rows, so a rank runs E/ep GEMMs of that many rows (smaller GEMMs lose efficiency
through GEMM_HALF_DIM). Dispatch and combine are one all-to-all each of k·T·h activations per rank
forward, the same again backward, not overlapped (the engine does not); the EP group is ep ranks at
stride tp·cp, over NVLink when the tp·cp·ep ranks fit in a node, else the part leaving the node goes
through each GPU's own NIC.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.planner.counts import mean_keys_per_query
from engine.config import ModelConfig
from engine.flops import GPUSpec, attention_matrices, attention_splits, mlp_matrices, qk_channels
from engine.layout import Layout
from engine.planner.activations import layer_activation_bytes
from engine.planner.links import Link, Links, all_reduce, all_to_all
from engine.planner.params import tensor_parallel
from engine.planner.software import Software

# Fraction of the dense peak the layer GEMMs of a training step reach, large-shape limit. A100: fitted
# (0.74; it folds in launch gaps and small kernels the model does not list) on Narayanan et al. 2021's
# Table 1. H100: fitted (0.66) on the held-in H100 runs of engine/planner/published.py (llm-foundry, Llama 3
# 405B on 8,192 GPUs); H200 has the same GH100 compute. B200: the A100 fit scaled by the ratio of
# cuBLAS large-shape bf16 efficiencies (~70% of peak vs ~85%); no published B200 run is checked.
GEMM_EFFICIENCY = {"a100-40g": 0.74, "a100-80g": 0.74, "h100-sxm": 0.66, "h100-pcie": 0.66,
                   "h200": 0.66, "b200": 0.61}
GEMM_EFFICIENCY_DEFAULT = 0.65
# Each GEMM dimension x costs a factor x/(x + GEMM_HALF_DIM): small dimensions leave tensor cores
# idle (tile quantisation, wave effects). Fitted.
GEMM_HALF_DIM = 64.0
# Flash attention's attention-core throughput as a fraction of the dense peak, in the FLOPs this planner
# counts (the full s x s scores: a causal kernel skips half of them, so these can exceed what the
# kernel's own counter reports), and its backward-to-forward time ratio (5 matmuls vs 2).
# A100: FlashAttention-2 paper (Dao 2023), 50-73% of peak forward. H100: fitted (see below).
FLASH_ATTENTION_EFFICIENCY = {"a100-40g": 0.5, "a100-80g": 0.5, "h100-sxm": 0.5, "h100-pcie": 0.5,
                              "h200": 0.5, "b200": 0.5}
FLASH_ATTENTION_DEFAULT = 0.5
FLASH_BACKWARD_RATIO = 2.5
# Unfused attention (Megatron-LM 2021-22): scaled-masked softmax reads and writes the scores, then
# dropout reads them and writes output and a 1-byte mask: 2+2+2+2+1 bytes per score forward.
UNFUSED_SCORE_TRAFFIC = 9
# Element-wise work (norms, bias, activation, dropout, residual adds, rotary) moves about twice the
# bytes it stores for backward (each saved tensor is written once and read once); backward twice that.
# (2 was also the best of 1-3 when fitting the two constants above.)
ELEMENTWISE_TRAFFIC = 2.0
# Bytes moved per logit by the loss, forward and backward: the max/sum-exp pass and the gradient pass
# read the 2-byte logits, the gradient is written, the output GEMMs' epilogues and fp32 temporaries.
CROSS_ENTROPY_TRAFFIC = 20
HBM_EFFICIENCY = 0.8          # achievable fraction of HBM bandwidth for streaming kernels (STREAM-like)
# The MoE router runs in fp32 (engine/moe/router.py) on CUDA cores, not tensor cores: their fp32 peak is
# 1/16 (A100: 19.5 of 312 TFLOP/s) to 1/15 (H100 SXM: 67 of 989) of the dense bf16 peak (NVIDIA data sheets).
FP32_SLOWDOWN = 15.0
# FP8 (engine/fp8): the dense FP8 tensor-core peak is twice the bf16 one on Hopper (H100 SXM: 1,979 vs 989
# TFLOP/s, NVIDIA data sheet), and FP8 GEMMs reach a smaller share of theirs. Measured by gpu-check: at 8192^3
# 1.78x bf16's rate on an H100 (1,378 against 772 TFLOP/s, 2026-11-26) and 1.87x on an H200 (1,489 against 798,
# 2026-11-27); inside the 1.24B Llama's step on that H200 (`step_profile`, micro batch 2), the hidden linears'
# 384 torch._scaled_mm took 35.3 ms where their bf16 products took 61.3: 1.74x. So tensor-scaled hidden GEMMs
# (tensorwise, delayed) run 1.75x faster (torchao reports 1.5-1.8x at large shapes). Blockwise and the experts'
# GEMMs run dequantized at the bf16 rate in this engine (engine/fp8/gemm.py); the attention core stays in bf16,
# and so does the output layer unless --fp8-output-layer (Software.fp8_output_layer) puts it in FP8 too.
FP8_GEMM_SPEEDUP = 1.75
# Quantizing, per element of each FP8 operand but the weights (the GEMMs' inputs and output gradients; a weight is
# quantized once a step, engine.fp8.weights_held), as engine/fp8 does it on CUDA. Tensor scaling reads the bf16
# operand once and writes its codes and their transpose (the weight gradient's operand) in one pass
# (kernels/fp8_triton.py): 4 bytes under delayed scaling, whose scale is known before; current scaling (tensorwise)
# reads it once more first for the amax: 6. Blockwise reads it for its tiles' amaxes (2) and casts it (3), then
# does both again along the tokens for the weight gradient: 10.
FP8_CAST_TRAFFIC = {"tensorwise": 6, "delayed": 4, "blockwise": 10}
# A SwiGLU MLP without biases under tensor scaling makes SwiGLU's output (fc2's input) and input gradient (fc1's
# output gradient) as FP8 codes, row-major and transposed, in the kernel that computes them (engine/fp8/mlp.py):
# its two 1-byte writes replace SwiGLU's own 2-byte bf16 write, so under delayed scaling quantizing them costs
# nothing beyond SwiGLU's traffic; current scaling (tensorwise) first reads SwiGLU's inputs once more for the amax:
# gate and up (4 bytes an output element) forward, gate, up and the output gradient (6 bytes for the 2 elements
# of the input gradient: 3) backward. (fc2-input bytes, fc1-output-gradient bytes) per element.
FUSED_SWIGLU_CAST_TRAFFIC = {"tensorwise": (4, 3), "delayed": (0, 0)}
# The routed experts quantize per token (engine/fp8/experts.py: each row's amax, the cast, and the codes
# dequantized again for the weight gradient), apart from the kernels above: about 7 bytes an element (10 blockwise).
EXPERT_CAST_TRAFFIC = {"tensorwise": 7, "delayed": 7, "blockwise": 10}


def gemm_seconds(m: float, n: float, k: float, gpu: GPUSpec, speedup: float = 1.0) -> float:
    """`speedup`: over the bf16 rate (FP8_GEMM_SPEEDUP for an FP8 GEMM)."""
    eff = GEMM_EFFICIENCY.get(gpu.name, GEMM_EFFICIENCY_DEFAULT) * speedup
    for x in (m, n, k):
        eff *= x / (x + GEMM_HALF_DIM)
    return 2 * m * n * k / (gpu.peak_tflops * 1e12 * eff)


def fp8_speedup(sw: Software) -> float:
    """The hidden dense GEMMs' rate over bf16: FP8 tensor cores for tensor-scaled recipes, else 1."""
    return FP8_GEMM_SPEEDUP if sw.fp8 in ("tensorwise", "delayed") else 1.0


def experts_fp8_speedups(sw: Software) -> tuple:
    """The routed experts' (forward, input gradient, weight gradient) GEMM rates over bf16 (engine/fp8/experts.py):
    under tensor scaling forward runs on FP8 tensor cores with row-wise scales, the input gradient too when the
    gradients are e4m3 (`--fp8-format e4m3`; hybrid's e5m2 ones are not taken), the weight gradient never (its
    per-token scales vary along the tokens it sums over)."""
    fast = fp8_speedup(sw)
    return fast, (fast if sw.fp8_format == "e4m3" else 1.0), 1.0


def _mlp_cast_bytes(model: ModelConfig, ffn: float, sw: Software, routed: bool = False) -> float:
    """Bytes per token an MLP of width ffn (this rank's share) moves quantizing fc1's and fc2's inputs and output
    gradients: FP8_CAST_TRAFFIC an element (EXPERT_CAST_TRAFFIC for `routed` experts), but FUSED_SWIGLU_CAST_TRAFFIC
    for SwiGLU's two tensors where the MLP makes them as codes (a dense or shared-expert SwiGLU MLP without biases,
    tensor scaling)."""
    (fc1_rows, fc1_cols), (fc2_rows, fc2_cols) = mlp_matrices(model, ffn)
    each = (EXPERT_CAST_TRAFFIC if routed else FP8_CAST_TRAFFIC)[sw.fp8]
    fused = not routed and model.swiglu and model.disable_bias_linear and sw.fp8 in FUSED_SWIGLU_CAST_TRAFFIC
    swiglu_out, swiglu_grad = FUSED_SWIGLU_CAST_TRAFFIC[sw.fp8] if fused else (each, each)
    return each * (fc1_cols + fc2_rows) + swiglu_out * fc2_cols + swiglu_grad * fc1_rows


def _fp8_casts(model: ModelConfig, tokens: float, t: int, gpu: GPUSpec, sw: Software,
               experts: tuple = (0, 0.0)) -> float:
    """Seconds of one layer's FP8 casts, forward and backward: its FP8 linears' inputs and output gradients (their
    tp shares) for this rank's tokens. A dense layer's MLP is the config's; an MoE layer's (`experts`: how many
    routed experts this rank holds, and the rows each gets) its shared expert for the tokens and each routed
    expert for its rows (quantized per token, then dequantized for the weight gradient: about the same bytes)."""
    if sw.fp8 is None:
        return 0.0
    local, rows = experts
    if local:
        shared = model.moe_shared_expert_intermediate_size or 0
        per_token = _mlp_cast_bytes(model, shared / t, sw) if shared else 0.0
        routed = local * rows * _mlp_cast_bytes(model, model.resolved_moe_ffn_hidden_size(), sw, routed=True)
    else:
        per_token, routed = _mlp_cast_bytes(model, model.resolved_ffn_hidden_size() / t, sw), 0.0
    for (rows_, cols), axis in zip(attention_matrices(model), attention_splits(model)):
        if tensor_parallel(axis):  # the FP8 linears (MLA's replicated latents are not)
            width = (cols / t if axis == 1 else cols) + (rows_ / t if axis == 0 else rows_)
            per_token += FP8_CAST_TRAFFIC[sw.fp8] * width
    return (tokens * per_token + routed) / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)


def _head_casts(model: ModelConfig, tokens: float, t: int, gpu: GPUSpec, sw: Software) -> float:
    """Seconds of the output layer's FP8 casts under --fp8-output-layer, forward and backward: its input (the whole
    hidden width, as a column-parallel linear's) and its output gradient (this rank's vocabulary share)."""
    if sw.fp8 is None or not sw.fp8_output_layer:
        return 0.0
    width = model.hidden_size + model.padded_vocab_size(t) / t
    return FP8_CAST_TRAFFIC[sw.fp8] * tokens * width / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)


def _attention_seconds(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software) -> tuple:
    """(forward, backward) seconds of one layer's attention core for one microbatch on one GPU. Under cp
    each rank computes 1/cp of the (load-balanced) score blocks."""
    b, t, cp = layout.micro_batch_size, layout.tp, layout.cp
    (qk, v), heads = qk_channels(model), model.num_attention_heads / t
    keys = mean_keys_per_query(model, seq)  # the layers' average: windowed layers count their window
    if sw.flash_attention:  # which skips the blocks of other documents too (the materialised scores do not)
        eff = sw.attention_efficiency or FLASH_ATTENTION_EFFICIENCY.get(gpu.name, FLASH_ATTENTION_DEFAULT)
        keys = mean_keys_per_query(model, seq, sw.document_length)
        fwd = 2 * b * seq * keys * heads * (qk + v) / cp / (gpu.peak_tflops * 1e12 * eff)
        return fwd, FLASH_BACKWARD_RATIO * fwd
    s_local = seq / cp
    per_head = gemm_seconds(s_local, keys, qk, gpu) + gemm_seconds(s_local, v, keys, gpu)
    softmax = UNFUSED_SCORE_TRAFFIC * heads * b * s_local * keys / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    fwd = b * heads * per_head + softmax
    return fwd, 2 * fwd


def _cp_comm(model: ModelConfig, layout: Layout, seq: int, sw: Software, link: Link, attn: tuple) -> float:
    """Exposed seconds of the K/V exchange of one layer, forward and backward. Forward: every rank sends
    cp - 1 blocks of K and V ((s/cp) b (groups/tp) d elements each; under MLA every head's, the values padded to
    the q/k channels as the ring carries them); backward sends K/V again plus their
    gradients (2x). The ring overlaps each step's transfer with the attention of the block in hand;
    all_gather gathers K/V before attention (Llama 3's choice), so nothing hides it."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    block = (seq / cp) * layout.micro_batch_size * model.resolved_query_groups() / layout.tp * 2 * qk_channels(model)[0]
    fwd = (cp - 1) * (link.seconds(2 * block) - link.latency) + (cp - 1) * link.latency
    bwd = 2 * fwd
    if sw.cp_comm_type == "all_gather":
        return fwd + bwd
    return max(0.0, fwd - attn[0]) + max(0.0, bwd - attn[1])


@dataclass
class LayerCosts:
    """Per-microbatch seconds for one layer, the embedding and the output layer, on one GPU."""
    layer_fwd: float
    layer_bwd: float
    layer_recompute: float
    embed: float
    head: float
    p2p: float
    cp_comm: float      # exposed K/V ring (or all-gather) time per layer, forward + backward
    moe_fwd: float = 0.0        # an MoE layer's forward, backward and recomputed seconds (all-to-all included)
    moe_bwd: float = 0.0
    moe_recompute: float = 0.0
    moe_a2a: float = 0.0        # of which all-to-all, forward + backward


def layer_costs(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software,
                links: Links) -> LayerCosts:
    """The seconds of a dense layer and (with experts) an MoE layer, the embedding, the output layer and a
    pipeline send, for one microbatch on one GPU."""
    t, h = layout.tp, model.hidden_size
    tokens = layout.micro_batch_size * seq / layout.cp  # this rank's share of the microbatch
    fast = fp8_speedup(sw)
    attn_gemm = _attention_gemm(model, layout, tokens, gpu, fast)
    gemm = attn_gemm + _mlp_gemm(model, tokens, model.resolved_ffn_hidden_size() / t, gpu, fast)
    attn_fwd, attn_bwd = _attention_seconds(model, layout, seq, gpu, sw)
    stored = layer_activation_bytes(model, seq, layout.micro_batch_size, t, layout.sequence_parallel, "none",
                                    flash_attention=True, cp=layout.cp)
    elementwise = ELEMENTWISE_TRAFFIC * stored / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY) + \
        _fp8_casts(model, tokens, t, gpu, sw) / 3  # forward's third; backward's two thirds come with 2 x elementwise
    tp_comm = _tp_comm(2, tokens * h, layout, sw, links.tp)
    fwd = gemm + attn_fwd + elementwise + tp_comm
    bwd = 2 * gemm + attn_bwd + 2 * elementwise + tp_comm
    recompute = {"full": fwd, "selective": attn_fwd}.get(layout.recompute, 0.0)
    vocab = model.padded_vocab_size(t)
    logits_traffic = CROSS_ENTROPY_TRAFFIC * tokens * vocab / t / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    head = 3 * gemm_seconds(tokens, vocab / t, h, gpu, fast if sw.fp8_output_layer else 1.0) + logits_traffic + \
        _head_casts(model, tokens, t, gpu, sw) + 2 * all_reduce(2 * tokens * h, t, links.tp)
    embed = 2 * all_reduce(2 * tokens * h, t, links.tp)
    # Megatron's scatter-gather optimisation (or sequence parallelism) sends 1/t of the activations.
    p2p = links.pp.seconds(2 * tokens * h / t) if layout.pp > 1 else 0.0
    cp_comm = _cp_comm(model, layout, seq, sw, links.cp, (attn_fwd, attn_bwd))
    moe = _moe_layer(model, layout, seq, gpu, sw, links, (attn_gemm, attn_fwd, attn_bwd)) if model.num_experts else ()
    return LayerCosts(fwd, bwd, recompute, embed, head, p2p, cp_comm, *moe)


def _tp_comm(entries: int, elements: float, layout: Layout, sw: Software, link: Link) -> float:
    """The exposed seconds, forward's and again backward's, of `entries` entries into and exits from the
    tensor-parallel region of `elements` activations each (this rank's tokens x hidden): each pair an
    all-reduce's volume of bf16 (an all-gather in and a reduce-scatter out under sequence parallelism, a copy in
    and an all-reduce out without; the adjoints in backward). Under SP with FP8 tensor scaling the all-gathers
    move 1-byte codes, forward's of the inputs and backward's of the output gradients (engine.fp8.linear): 1 + 2
    bytes an element for the pair, the volume of an all-reduce of 1.5."""
    width = 1.5 if layout.sequence_parallel and sw.fp8 in ("tensorwise", "delayed") else 2
    return entries * all_reduce(width * elements, layout.tp, link) * (1 - sw.tp_comm_overlap)


def _attention_gemm(model: ModelConfig, layout: Layout, tokens: float, gpu: GPUSpec,
                    speedup: float = 1.0) -> float:
    """Forward seconds of the attention's projections over this rank's `tokens`: column-parallel ones split by
    rows, row-parallel ones by columns, replicated ones (MLA's latent down-projections) whole, on 1/tp of the
    tokens under sequence parallelism. `speedup` (FP8) applies to the tensor-parallel ones; the replicated
    latent projections are not FP8 linears and run at the bf16 rate."""
    t, seconds = layout.tp, 0.0
    for (rows, cols), axis in zip(attention_matrices(model), attention_splits(model)):
        mine = tokens / t if axis is None and layout.sequence_parallel else tokens
        seconds += gemm_seconds(mine, rows / t if axis == 0 else rows, cols / t if axis == 1 else cols, gpu,
                                1.0 if axis is None else speedup)
    return seconds


def _mlp_gemm(model: ModelConfig, rows: float, ffn: float, gpu: GPUSpec, speedup: float = 1.0) -> float:
    """Forward seconds of an MLP of width ffn (this rank's share) over `rows` tokens: fc1 and fc2."""
    if rows == 0 or ffn == 0:
        return 0.0
    (fc1_rows, fc1_cols), (fc2_rows, fc2_cols) = mlp_matrices(model, ffn)
    return gemm_seconds(rows, fc1_rows, fc1_cols, gpu, speedup) + gemm_seconds(rows, fc2_rows, fc2_cols, gpu, speedup)


def _moe_layer(model: ModelConfig, layout: Layout, seq: int, gpu: GPUSpec, sw: Software, links: Links,
               attn: tuple) -> tuple:
    """(forward, backward, recomputed, all-to-all) seconds of one MoE layer for one microbatch on one GPU.
    attn: the layer's attention GEMMs and its attention core forward and backward (as in a dense layer)."""
    attn_gemm, attn_fwd, attn_bwd = attn
    t, h, E, k, ep = layout.tp, model.hidden_size, model.num_experts, model.moe_router_topk, layout.ep
    tokens = layout.micro_batch_size * seq / layout.cp
    routed = tokens / (t if layout.sequence_parallel else 1)  # each tp rank routes its own tokens under SP
    rows = k * routed * ep / E  # per expert, balanced routing over the EP group
    forward, dgrad, wgrad = (E / ep * _mlp_gemm(model, rows, model.resolved_moe_ffn_hidden_size(), gpu, speedup)
                             for speedup in experts_fp8_speedups(sw))
    shared = _mlp_gemm(model, tokens, (model.moe_shared_expert_intermediate_size or 0) / t, gpu, fp8_speedup(sw))
    router = FP32_SLOWDOWN * gemm_seconds(routed, E, h, gpu)
    gemm = attn_gemm + shared + router
    stored = layer_activation_bytes(model, seq, layout.micro_batch_size, t, layout.sequence_parallel, "none",
                                    flash_attention=True, cp=layout.cp, moe=True)
    elementwise = ELEMENTWISE_TRAFFIC * stored / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY) + \
        _fp8_casts(model, tokens, t, gpu, sw, (E / ep, rows)) / 3  # forward's third, as in a dense layer
    # The attention's TP collectives, and the shared expert's; the routed experts need none (tokens stay put).
    n_tp = 1 + bool(model.moe_shared_expert_intermediate_size)
    tp_comm = _tp_comm(n_tp, tokens * h, layout, sw, links.tp)
    a2a = 2 * all_to_all(2 * k * routed * h, ep, links)  # dispatch and combine, bf16 activations
    fwd = gemm + forward + attn_fwd + elementwise + tp_comm + a2a
    bwd = 2 * gemm + dgrad + wgrad + attn_bwd + 2 * elementwise + tp_comm + a2a
    recompute = {"full": fwd, "selective": attn_fwd}.get(layout.recompute, 0.0)
    return fwd, bwd, recompute, 2 * a2a

"""The model's section: what the decoder is (engine/model.py builds it), with the sizes derived from it."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Optional

from engine.config.fields import MEGATRON_REQUIRED, OWN, _err, _f


def _layer_list(flag: str, freq, num_layers: int, example: str) -> list:
    """Megatron-LM's per-layer list expression of 0s and 1s (lists, integers, + and * only), e.g. '[0]*3+[1]*29'
    or '([1]*3+[0])*2', as one 0/1 per layer; anything else is one line naming `flag`."""
    text = str(freq).strip()

    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(text)
    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        _err(flag, freq, f"give N or a list of {num_layers} 0/1 values (one per layer), e.g. '{example}'")
    return pattern


def _every_nth(flag: str, freq, example: str) -> Optional[int]:
    """N of a frequency flag given as an integer (or its digits), None when it is a list expression."""
    text = str(freq).strip()
    if not text.lstrip("-").isdigit():
        return None
    if int(text) < 1:
        _err(flag, freq, f"must be at least 1, or a list of 0/1 per layer like '{example}'")
    return int(text)


def moe_layer_pattern(freq, num_layers: int) -> list:
    """--moe-layer-freq as one 0/1 per layer: an integer N (layers 0, N, 2N, ... are MoE) or Megatron-LM's list
    expression of 0s and 1s, e.g. '[0]*3+[1]*29' or '[0,1,1,1]'."""
    example = f"[0]*1+[1]*{num_layers - 1}"
    n = _every_nth("--moe-layer-freq", freq, example)
    if n is not None:
        return [int(i % n == 0) for i in range(num_layers)]
    return _layer_list("--moe-layer-freq", freq, num_layers, example)


def window_size_pair(value) -> Optional[tuple]:
    """--window-size as Megatron-LM's (left, right) pair: a query at position i sees the keys at i - left .. i +
    right (the query's own position is not counted in either), -1 meaning no bound on that side. Given as
    'L,R', '(L,R)' or a YAML list; None when not given."""
    if value is None:
        return None
    parts = value if isinstance(value, (list, tuple)) else str(value).strip().strip("()[]").split(",")
    try:
        left, right = (int(str(p).strip()) for p in parts)
    except ValueError:
        left = right = None
    if left is None or left < -1:
        _err("--window-size", value, "give L,R with L >= 0 keys before each query (or -1: no bound), e.g. 4095,0")
    if right != 0:
        _err("--window-size", value, f"this decoder is causal: a query sees no later key, so the right side must be "
                                     f"0 (use {left},0)")
    return left, right


def window_layer_pattern(freq, num_layers: int) -> list:
    """--window-attn-skip-freq as one 0/1 per layer, 1 where the layer has the window (Megatron-Core's
    is_layer_window_attention): None, every layer; an integer N, all but every Nth layer counting from 1
    (layers N-1, 2N-1, ... from 0 get full attention); a list expression, 1 for window and 0 for full."""
    if freq is None:
        return [1] * num_layers
    example = f"[1]*{num_layers - 1}+[0]"
    n = _every_nth("--window-attn-skip-freq", freq, example)
    if n is not None:
        return [int((i + 1) % n != 0) for i in range(num_layers)]
    return _layer_list("--window-attn-skip-freq", freq, num_layers, example)


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "number of transformer layers", megatron=MEGATRON_REQUIRED)
    hidden_size: int = _f(64, "model width", megatron=MEGATRON_REQUIRED)
    ffn_hidden_size: Optional[int] = _f(None, "MLP width (default 4*hidden, or 8/3*hidden rounded to 64 with --swiglu)")
    num_attention_heads: int = _f(4, "attention heads", megatron=MEGATRON_REQUIRED)
    num_query_groups: Optional[int] = _f(None, "key/value heads for grouped-query attention (default: heads, i.e. MHA)")
    kv_channels: Optional[int] = _f(None, "per-head dimension (default hidden/heads)")
    seq_length: int = _f(64, "tokens per sample", megatron=MEGATRON_REQUIRED)
    max_position_embeddings: Optional[int] = _f(None, "learned position table size (default seq-length)")
    vocab_size: Optional[int] = _f(None, "vocabulary size (default: from the tokenizer, or 256 with --mock-data)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this times tp")
    normalization: str = _f("LayerNorm", "normalization layer", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = _f(1e-5, "epsilon of the normalization layers")
    position_embedding_type: str = _f("learned_absolute", "position encoding", choices=("learned_absolute", "rope"))
    rotary_base: float = _f(10000.0, "RoPE base frequency")
    use_rope_scaling: bool = _f(False, "Llama 3.x RoPE frequency scaling (HF rope_type llama3)")
    rope_scaling_factor: float = _f(8.0, "with --use-rope-scaling: divide the low frequencies by this")
    rope_scaling_low_freq_factor: float = _f(1.0, "with --use-rope-scaling: wavelengths above original/this are "
                                                  "divided by the factor (HF low_freq_factor)", megatron=OWN)
    rope_scaling_high_freq_factor: float = _f(4.0, "with --use-rope-scaling: wavelengths below original/this are "
                                                   "kept (HF high_freq_factor); those between are blended", megatron=OWN)
    rope_scaling_original_max_position_embeddings: int = _f(8192, "with --use-rope-scaling: the context length "
                                                                  "the model was pretrained with", megatron=OWN)
    qk_layernorm: bool = _f(False, "normalize queries and keys (QK-norm) after the QKV projection, before RoPE, "
                                   "with --normalization and --norm-epsilon (Qwen3, OLMo-2)")
    qk_layernorm_scope: str = _f("head", "with --qk-layernorm: over each head's channels (Qwen3, Megatron-LM's "
                                         "--qk-layernorm) or over the whole q and the whole k projection (OLMo-2; "
                                         "RMSNorm only)", choices=("head", "projection"), megatron=OWN)
    norm_placement: str = _f("pre", "where a layer's two norms sit: on each sublayer's input (pre: GPT-2, Llama) or "
                                    "on its output before the residual add, x + norm(f(x)) (post: OLMo-2; not the "
                                    "original Transformer's norm(x + f(x)))", choices=("pre", "post"), megatron=OWN)
    swiglu: bool = _f(False, "SwiGLU MLP instead of GELU")
    openai_gelu: bool = _f(False, "tanh approximation of GELU (HF gelu_new) instead of the exact erf form")
    untie_embeddings_and_output_weights: bool = _f(False, "separate output layer instead of the tied embedding")
    disable_bias_linear: bool = _f(False, "no biases in linear layers")
    add_qkv_bias: bool = _f(False, "a bias in the QKV projection even with --disable-bias-linear (Qwen2)")
    hidden_dropout: float = _f(0.1, "dropout on the residual branches")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities")
    init_method_std: float = _f(0.02, "std of the normal weight init; output projections use std/sqrt(2*layers)")
    window_size: Optional[str] = _f(None, "sliding-window attention 'L,0': each query sees itself and the L keys "
                                          "before it (transformers' sliding_window W is W-1,0; -1: no bound)")
    window_attn_skip_freq: Optional[str] = _f(None, "with --window-size, the layers with full attention instead: N "
                                                    "(every Nth layer counting from 1) or a 0/1 list per layer, 1 for "
                                                    "window, e.g. '[1,1,0]*4' (default: the window on every layer)")
    attention_backend: str = _f("auto", "attention implementation (auto picks the fastest available; Megatron-LM's "
                                "fused and unfused are read as auto and local)",
                                choices=("auto", "flash", "triton", "sdpa", "local", "fused", "unfused"))
    recompute_granularity: Optional[str] = _f(None, "activation recomputation", choices=("full", "selective"))
    recompute_num_layers: Optional[int] = _f(None, "with full recomputation: layers per stage recomputed (default all)")
    # Mixture of experts (engine/moe): Megatron-LM's flags
    num_experts: Optional[int] = _f(None, "routed experts per MoE layer (default: no MoE layers)")
    moe_layer_freq: str = _f("1", "which layers are MoE: N (every Nth, from layer 0) or a 0/1 list per layer, "
                                  "e.g. '[0]*1+[1]*3' (dense first layer)")
    moe_ffn_hidden_size: Optional[int] = _f(None, "width of each routed expert (default --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: Optional[int] = _f(None, "width of the shared expert every token "
                                                                  "also goes through (DeepSeek style; default none)")
    moe_router_topk: int = _f(2, "experts each token is routed to")
    moe_router_score_function: str = _f("softmax", "router scores: softmax over the top-k logits (Mixtral), or "
                                                   "sigmoid normalised over the top-k (DeepSeek-V3)",
                                        choices=("softmax", "sigmoid"))
    moe_router_topk_scaling_factor: Optional[float] = _f(None, "multiply the top-k routing weights by this")
    moe_router_load_balancing_type: str = _f("aux_loss", "auxiliary balancing loss over the batch, per sequence, "
                                                         "or none", choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = _f(0.0, "weight of the load-balancing loss (0: none)")
    moe_z_loss_coeff: Optional[float] = _f(None, "weight of the router z-loss (mean squared logsumexp of logits)")
    moe_router_enable_expert_bias: bool = _f(False, "aux-loss-free balancing: a per-expert bias added to the scores "
                                                    "for choosing experts only, moved towards balance every step")
    moe_router_bias_update_rate: float = _f(1e-3, "step of the expert-bias update (sign of the load error)")
    moe_expert_capacity_factor: Optional[float] = _f(None, "tokens an expert takes, as a multiple of an even "
                                                           "share; the rest are dropped (default: dropless)")
    moe_token_drop_policy: str = _f("probs", "over capacity, drop the tokens with the lowest routing weight "
                                             "(probs) or the latest in the batch (position)",
                                    choices=("probs", "position"))
    moe_router_dtype: str = _f("fp32", "dtype of the router's logits, scores and routing decisions (at least fp32 "
                                       "here)", choices=("fp32", "fp64"), megatron="unset, the model's dtype")
    moe_router_num_groups: Optional[int] = _f(None, "group-limited routing: the experts form this many equal groups "
                                                    "(by id; DeepSeek-V3: one per node), default none")
    moe_router_group_topk: Optional[int] = _f(None, "with --moe-router-num-groups: each token's experts come from this "
                                                    "many groups, ranked by the sum of each group's top-2 scores")
    # Multi-head latent attention (engine/latent_attention.py) and multi-token prediction (engine/mtp.py):
    # Megatron-LM's flags
    multi_latent_attention: bool = _f(False, "multi-head latent attention (DeepSeek-V2/V3): keys and values from a "
                                             "low-rank latent, a decoupled RoPE part shared by the heads")
    q_lora_rank: Optional[int] = _f(None, "with MLA: rank of the query latent (default none: one q projection)")
    kv_lora_rank: int = _f(32, "with MLA: rank of the key/value latent")
    qk_head_dim: int = _f(128, "with MLA: per-head q/k channels without position encoding")
    qk_pos_emb_head_dim: int = _f(64, "with MLA: per-head q/k channels with RoPE (the key's shared by all heads)")
    v_head_dim: int = _f(128, "with MLA: per-head value channels")
    rope_type: Optional[str] = _f(None, "RoPE form of MLA: yarn (default with MLA) or rope", choices=("rope", "yarn"))
    rotary_scaling_factor: float = _f(1.0, "YaRN: context extension factor (DeepSeek-V3: 40; 1 is plain RoPE)")
    original_max_position_embeddings: int = _f(4096, "YaRN: the context length the model was pretrained with",
                                                 megatron="unset (megatron-core's MLA config: 4096)")
    beta_fast: float = _f(32.0, "YaRN: rotations above which frequencies are kept (extrapolated)",
                          megatron="unset (megatron-core's MLA config: 32)")
    beta_slow: float = _f(1.0, "YaRN: rotations below which frequencies are divided by the factor (interpolated)",
                          megatron="unset (megatron-core's MLA config: 1)")
    mscale: float = _f(1.0, "YaRN: scale of log(factor) in the RoPE part's magnitude (numerator)")
    mscale_all_dim: float = _f(0.0, "YaRN: the same for the softmax scale and the denominator (DeepSeek-V3: 1)")
    mtp_num_layers: Optional[int] = _f(None, "multi-token prediction: sequential modules after the decoder, module k "
                                             "predicting the token k+1 ahead (DeepSeek-V3: 1)")
    mtp_loss_scaling_factor: float = _f(0.1, "weight of the mean MTP loss added to the LM loss")

    def moe_layers(self) -> list:
        """Global ids of the MoE layers (empty without --num-experts)."""
        if not self.num_experts:
            return []
        return [i for i, moe in enumerate(moe_layer_pattern(self.moe_layer_freq, self.num_layers)) if moe]

    def rope_dim(self) -> int:
        """Channels RoPE rotates in each head: the decoupled part under MLA, else the whole head."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim()

    def yarn(self) -> bool:
        """Whether RoPE is YaRN-scaled (MLA's default form)."""
        return self.multi_latent_attention and self.rope_type in (None, "yarn")

    def mtp_layers(self) -> list:
        """Global ids of the multi-token prediction modules' transformer layers: after the decoder's."""
        return list(range(self.num_layers, self.num_layers + (self.mtp_num_layers or 0)))

    def routed_layers(self) -> list:
        """Global ids of every layer with routed experts: the MoE layers, and the MTP modules' layers when the
        decoder's last layer is one (they are built like it)."""
        moe = self.moe_layers()
        return moe + (self.mtp_layers() if self.num_layers - 1 in moe else [])

    def attention_window(self, layer: int) -> Optional[int]:
        """L of layer `layer`'s sliding window (a query sees keys at most L positions before it), or None where the
        layer attends to every earlier position (no --window-size, an unbounded -1, or a skipped layer). An MTP
        module's layer attends as the decoder's last layer."""
        pair = window_size_pair(self.window_size)
        if pair is None or pair[0] < 0:
            return None
        pattern = window_layer_pattern(self.window_attn_skip_freq, self.num_layers)
        return pair[0] if pattern[min(layer, self.num_layers - 1)] else None

    def resolved_moe_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.resolved_ffn_hidden_size()

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return 64 * ((int(8 * self.hidden_size / 3) + 63) // 64)
        return 4 * self.hidden_size

    def resolved_query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The vocabulary as the embedding and output layer hold it at tensor-parallel size `tp`."""
        if self.vocab_size is None:
            raise ValueError("the vocabulary size is not resolved yet: call engine.resolve.resolve(cfg, world_size)")
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """The vocabulary padded up to a multiple of --make-vocab-size-divisible-by x tp (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple

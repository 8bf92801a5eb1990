"""Typed run configuration: dataclasses per concern with Megatron-LM flag names. A description only: it opens
no file and imports nothing else of the engine.

Every field of every section is a command-line flag named after it (`num_layers` -> `--num-layers`);
YAML keys are the same names with `-` or `_`. engine/flags.py reads the flags off these sections and
engine/cli.py reads the command line and YAML files into a `Config` (flags given on the command line
override the file). engine/validation.py holds every check that can be made before any process group
exists; each failure is one `ConfigError` (raised by `_err`, here) naming the flag, the value and the fix.
What the flags leave to be derived (the vocabulary from the tokenizer, the global batch size from the
world) is filled in by engine/resolve.py.
"""
from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A user mistake in flags or files; the launcher prints it as one line and exits 2."""


def _err(flag: str, value, fix: str):
    raise ConfigError(f"{flag} {value}: {fix}")


def moe_layer_pattern(freq, num_layers: int) -> list:
    """--moe-layer-freq as one 0/1 per layer: an integer N (layers 0, N, 2N, ... are MoE) or Megatron-LM's list
    expression of 0s and 1s, e.g. '[0]*3+[1]*29' or '[0,1,1,1]' (lists, integers, + and * only)."""
    text = str(freq).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            _err("--moe-layer-freq", freq, "must be at least 1, or a list of 0/1 per layer like '[0]*1+[1]*3'")
        return [int(i % n == 0) for i in range(num_layers)]

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
        pattern = value(ast.parse(text.strip("()"), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        _err("--moe-layer-freq", freq, f"give N or a list of {num_layers} 0/1 values (one per layer), "
                                       f"e.g. '[0]*1+[1]*{num_layers - 1}'")
    return pattern


# --tokenizer-type, with Megatron-LM's names (engine.data.tokenizer_spec.TYPES: what each reads)
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


# The names --pipeline-schedule and --data-parallel-sharding-strategy take; what each means is engine/layout.py's.
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _f(default, help, *, aliases=(), choices=None, nargs=None, action=None, type=None, yaml_only=False):
    """A config field. `yaml_only`: a structured value (e.g. a list of mappings) with no command-line form."""
    meta = dict(help=help, aliases=aliases, choices=choices, nargs=nargs, action=action, type=type,
                yaml_only=yaml_only)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "number of transformer layers")
    hidden_size: int = _f(64, "model width")
    ffn_hidden_size: Optional[int] = _f(None, "MLP width (default 4*hidden, or 8/3*hidden rounded to 64 with --swiglu)")
    num_attention_heads: int = _f(4, "attention heads")
    num_query_groups: Optional[int] = _f(None, "key/value heads for grouped-query attention (default: heads, i.e. MHA)")
    kv_channels: Optional[int] = _f(None, "per-head dimension (default hidden/heads)")
    seq_length: int = _f(64, "tokens per sample")
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
                                                  "divided by the factor (HF low_freq_factor)")
    rope_scaling_high_freq_factor: float = _f(4.0, "with --use-rope-scaling: wavelengths below original/this are "
                                                   "kept (HF high_freq_factor); those between are blended")
    rope_scaling_original_max_position_embeddings: int = _f(8192, "with --use-rope-scaling: the context length "
                                                                  "the model was pretrained with")
    swiglu: bool = _f(False, "SwiGLU MLP instead of GELU")
    openai_gelu: bool = _f(False, "tanh approximation of GELU (HF gelu_new) instead of the exact erf form")
    untie_embeddings_and_output_weights: bool = _f(False, "separate output layer instead of the tied embedding")
    disable_bias_linear: bool = _f(False, "no biases in linear layers")
    add_qkv_bias: bool = _f(False, "a bias in the QKV projection even with --disable-bias-linear (Qwen2)")
    hidden_dropout: float = _f(0.0, "dropout on the residual branches")
    attention_dropout: float = _f(0.0, "dropout on attention probabilities")
    init_method_std: float = _f(0.02, "std of the normal weight init; output projections use std/sqrt(2*layers)")
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
    moe_router_dtype: Optional[str] = _f(None, "dtype of the router's computation (default: fp32 always here)",
                                         choices=("fp32", "fp64"))

    def moe_layers(self) -> list:
        """Global ids of the MoE layers (empty without --num-experts)."""
        if not self.num_experts:
            return []
        return [i for i, moe in enumerate(moe_layer_pattern(self.moe_layer_freq, self.num_layers)) if moe]

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


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size", aliases=("--tp",))
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size", aliases=("--pp",))
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "model chunks per pipeline rank (interleaved 1F1B)", aliases=("--vpp",))
    sequence_parallel: bool = _f(False, "split norms and dropout over the sequence within the TP group")
    pipeline_schedule: Optional[str] = _f(None, "pipeline schedule (default: 1f1b, interleaved with --vpp); zb-h1 and "
                                                "zb-v split each backward into input- and weight-gradient parts",
                                          choices=PIPELINE_SCHEDULES)
    context_parallel_size: int = _f(1, "context-parallel size: each sequence split over this many ranks "
                                       "(load-balanced causal chunks, ring attention)", aliases=("--cp",))
    cp_comm_type: str = _f("p2p", "how attention sees the other CP ranks' keys and values: p2p passes them round "
                                  "a ring, overlapped with attention; all_gather (Megatron-LM: allgather) gathers "
                                  "them once", choices=("p2p", "all_gather", "allgather"))
    use_distributed_optimizer: bool = _f(False, "shard fp32 master weights and Adam state over dp (ZeRO-1); the "
                                                "same as --data-parallel-sharding-strategy optim")
    data_parallel_sharding_strategy: Optional[str] = _f(
        None, "what is sharded over dp (Megatron-FSDP's names): no_shard, optim (ZeRO-1, the distributed optimizer), "
              "optim_grads (ZeRO-2: gradients too, reduce-scattered per microbatch), optim_grads_params (ZeRO-3: "
              "weights too, gathered per layer for forward and backward); default: optim with "
              "--use-distributed-optimizer, else no_shard", choices=SHARDING_STRATEGIES)
    overlap_grad_reduce: bool = _f(False, "start each gradient bucket's reduction as soon as backward fills it")
    overlap_param_gather: bool = _f(False, "optim_grads_params: gather the next layer's weights while this one "
                                           "computes (two layers' weights held instead of one)")
    gpus_per_node: Optional[int] = _f(None, "ranks per node (default: LOCAL_WORLD_SIZE); a TP group may not span nodes")
    expert_model_parallel_size: int = _f(1, "expert-parallel size: the experts of each MoE layer split over this "
                                            "many data-parallel ranks, tokens exchanged all-to-all", aliases=("--ep",))
    decoder_first_pipeline_num_layers: Optional[int] = _f(None, "layers on the first pipeline stage (uneven split)")
    decoder_last_pipeline_num_layers: Optional[int] = _f(None, "layers on the last pipeline stage (uneven split)")
    distributed_timeout_minutes: float = _f(10.0, "a collective stuck longer than this ends the job")


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(1, "samples per microbatch per data-parallel rank")
    global_batch_size: Optional[int] = _f(None, "samples per iteration over all dp ranks (default micro*dp)")
    rampup_batch_size: Optional[list] = _f(None, "batch ramp-up: START INCREMENT SAMPLES", nargs=3, type=int)
    train_iters: int = _f(100, "iterations to train")
    train_samples: Optional[int] = _f(None, "samples to train instead of --train-iters (Megatron-LM's sample-based "
                                            "run: the iterations are derived, the LR schedule counts samples)")
    bf16: bool = _f(False, "bf16 parameters and compute, fp32 master weights")
    fp16: bool = _f(False, "fp16 parameters and compute with loss scaling")
    loss_scale: Optional[float] = _f(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = _f(2.0 ** 16, "first dynamic loss scale for fp16")
    hysteresis: int = _f(1, "fp16: overflowing steps before the dynamic scale halves (Megatron-LM's default is 2)")
    seed: int = _f(1234, "random seed for weights, data order and dropout")
    device: str = _f("auto", "auto: cuda+nccl when GPUs are visible, else cpu+gloo", choices=("auto", "cuda", "cpu"))


@dataclass
class OptimizerConfig:
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    lr_decay_style: str = _f("cosine", "decay after warm-up (WSD: Megatron-LM's spelling of wsd)",
                             choices=("constant", "linear", "cosine", "inverse-square-root", "wsd", "WSD"))
    lr_warmup_iters: int = _f(0, "linear warm-up iterations")
    lr_decay_iters: Optional[int] = _f(None, "iterations over which the LR decays (default train-iters)")
    lr_wsd_decay_iters: Optional[int] = _f(None, "with wsd: length of the final decay phase")
    lr_wsd_decay_style: str = _f("exponential", "with wsd: shape of the final decay",
                                 choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_warmup_fraction: Optional[float] = _f(None, "warm-up length as this fraction of the decay length (instead of "
                                                   "--lr-warmup-iters/--lr-warmup-samples)")
    lr_warmup_init: float = _f(0.0, "learning rate at the start of the warm-up")
    lr_warmup_samples: int = _f(0, "with --train-samples: linear warm-up samples")
    lr_decay_samples: Optional[int] = _f(None, "with --train-samples: samples over which the LR decays (default "
                                               "train-samples)")
    lr_wsd_decay_samples: Optional[int] = _f(None, "with --train-samples and wsd: samples of the final decay phase")
    weight_decay: float = _f(0.01, "AdamW weight decay, matrices only")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient L2 norm to this (0: off)")
    z_loss_weight: float = _f(0.0, "weight of the log-sum-exp auxiliary loss on the logits")


@dataclass
class DataConfig:
    data_path: Optional[list] = _f(None, "[W1] PREFIX1 [W2 PREFIX2 ...]: indexed datasets and blend weights", nargs="+")
    split: str = _f("969,30,1", "train,valid,test proportions of the documents")
    tokenizer_model: Optional[str] = _f(None, "SentencePiece .model file, a tokenizer.json, or a transformers tokenizer "
                                              "directory")
    tokenizer_type: Optional[str] = _f(None, "how text becomes ids (default: implied by the files given, "
                                             "SentencePieceTokenizer for a .model file)", choices=TOKENIZER_TYPES)
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's merges.txt")
    eod_mask_loss: bool = _f(False, "no loss on the token that follows an end-of-document token (Megatron-LM's)")
    mock_data: bool = _f(False, "synthetic tokens that depend only on --seed and the sample index (a config "
                                "file's mock_data gives way to --data-path)")
    data_phases: Optional[list] = _f(None, "blend phases: a list of {start_iter, weights}", yaml_only=True)


@dataclass
class CheckpointConfig:
    save: Optional[str] = _f(None, "checkpoint directory to write")
    load: Optional[str] = _f(None, "checkpoint directory to resume from (default --save)")
    save_interval: Optional[int] = _f(None, "save every N iterations")
    async_save: bool = _f(False, "write checkpoints in the background")
    keep_last: Optional[int] = _f(None, "keep only the newest N checkpoints")
    keep_every: Optional[int] = _f(None, "also keep every checkpoint whose iteration is a multiple of N")
    ckpt_fallback: bool = _f(False, "if the newest checkpoint is damaged, load the newest complete one")
    no_load_optim: bool = _f(False, "load model weights only")
    finetune: bool = _f(False, "take only the model weights from --load: iteration 0, a fresh optimizer and data "
                               "position, no LR-schedule check (a restart resumes --save as usual)")
    pretrained_checkpoint: Optional[str] = _f(None, "checkpoint whose model weights start the run when --load and "
                                                    "--save hold none (as with --finetune)")
    override_opt_param_scheduler: bool = _f(False, "on resume, keep this run's LR schedule where the checkpoint's "
                                            "differs", aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = _f(False, "on resume, take the LR schedule the checkpoint was "
                                                  "trained with", aliases=("--use-checkpoint-opt_param-scheduler",))
    exit_duration_in_mins: Optional[float] = _f(None, "save and exit after this many minutes")
    exit_interval: Optional[int] = _f(None, "save and exit after the first iteration that is a multiple of N")


@dataclass
class LoggingConfig:
    log_interval: int = _f(1, "iterations between console lines")
    eval_interval: Optional[int] = _f(None, "iterations between evaluations")
    eval_iters: int = _f(10, "validation batches per evaluation")
    tensorboard_dir: Optional[str] = _f(None, "TensorBoard event directory")
    metrics_file: Optional[str] = _f(None, "JSON-lines metrics (default <tensorboard-dir>/metrics.jsonl or <save>/metrics.jsonl)")
    peak_tflops: Optional[float] = _f(None, "device peak TFLOP/s for MFU (default from the device table)")
    pipeline_trace: Optional[str] = _f(None, "write each rank's forward/backward events to this file")
    profile: bool = _f(False, "record a torch.profiler trace")
    profile_step_start: int = _f(10, "first profiled iteration")
    profile_step_end: int = _f(12, "last profiled iteration")


@dataclass
class StabilityConfig:
    spike_window: int = _f(50, "iterations in the rolling loss window")
    spike_threshold: float = _f(6.0, "a loss above mean + K std of the window is a spike")
    spike_rollback_after: int = _f(0, "roll back after N spikes within the window (0: never)")
    spike_lr_factor: float = _f(0.5, "LR multiplier after a rollback")
    spike_lr_steps: int = _f(100, "iterations the lowered LR lasts")
    inject_fault: list = _f([], "KIND@ITER with KIND nan or spike (repeatable; for drills and tests)", action="append")


SECTIONS = {
    "model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
    "optim": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
    "logging": LoggingConfig, "stability": StabilityConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    config_file: Optional[str] = None
    notices: list = field(default_factory=list)  # lines the launcher prints once (rank 0): choices made for the user
    # --vocab-size as given, kept by resolve() when a NullTokenizer adds its end-of-document id to it (so resolving
    # again does not add a second one)
    given_vocab_size: Optional[int] = None

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{name: SECTIONS[name](**d.get(name, {})) for name in SECTIONS})

    # Shorthands used all over the engine.
    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel_size

    def dp(self, world_size: int) -> int:
        """Data-parallel size: the model replicas of tp x cp x pp ranks in the world."""
        return world_size // (self.tp * self.cp * self.pp)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """The vocabulary padded up to a multiple of --make-vocab-size-divisible-by x tp (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple

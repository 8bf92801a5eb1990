"""The run's sections besides the model: parallel layout, training, optimizer, data, checkpoints, logging and
stability, each field a flag of Megatron-LM's name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.config.fields import (
    FP8_AMAX_ALGOS,
    FP8_BLACKWELL_RECIPES,
    FP8_FORMATS,
    FP8_RECIPES,
    MUON_COEFFICIENTS,
    MUON_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    SHARDING_STRATEGIES,
    MEGATRON_REQUIRED,
    OWN,
    TOKENIZER_TYPES,
    _f,
)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size", aliases=("--tp",))
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size", aliases=("--pp",))
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "model chunks per pipeline rank (interleaved 1F1B)", aliases=("--vpp",), megatron=OWN)
    sequence_parallel: bool = _f(False, "split norms and dropout over the sequence within the TP group")
    pipeline_schedule: Optional[str] = _f(None, "pipeline schedule (default: 1f1b, interleaved with --vpp); zb-h1 and "
                                                "zb-v split each backward into input- and weight-gradient parts",
                                          choices=PIPELINE_SCHEDULES, megatron=OWN)
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
    overlap_param_gather: bool = _f(False, "optim, optim_grads: all-gather the updated weights during the next "
                                           "forward, each layer waiting for its own; optim_grads_params: gather the "
                                           "next layer's weights while this one computes (two layers' held)")
    gpus_per_node: Optional[int] = _f(None, "ranks per node (default: LOCAL_WORLD_SIZE); a TP group may not span nodes", megatron=OWN)
    expert_model_parallel_size: int = _f(1, "expert-parallel size: the experts of each MoE layer split over this "
                                            "many data-parallel ranks, tokens exchanged all-to-all", aliases=("--ep",))
    decoder_first_pipeline_num_layers: Optional[int] = _f(None, "layers on the first pipeline stage (uneven split)")
    decoder_last_pipeline_num_layers: Optional[int] = _f(None, "layers on the last pipeline stage (uneven split)")
    distributed_timeout_minutes: float = _f(10.0, "a collective stuck longer than this ends the job")
    distributed_backend: Optional[str] = _f(None, "torch.distributed backend (default: nccl on CUDA, gloo on the "
                                                  "CPU); gloo on CUDA lets the ranks of a node share GPUs, e.g. 2-4 "
                                                  "ranks on one GPU", choices=("nccl", "gloo"))


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(1, "samples per microbatch per data-parallel rank", megatron=MEGATRON_REQUIRED)
    global_batch_size: Optional[int] = _f(None, "samples per iteration over all dp ranks (default micro*dp)")
    rampup_batch_size: Optional[list] = _f(None, "batch ramp-up: START INCREMENT SAMPLES", nargs=3, type=int)
    train_iters: int = _f(100, "iterations to train", megatron=MEGATRON_REQUIRED)
    train_samples: Optional[int] = _f(None, "samples to train instead of --train-iters (Megatron-LM's sample-based "
                                            "run: the iterations are derived, the LR schedule counts samples)")
    bf16: bool = _f(False, "bf16 parameters and compute, fp32 master weights")
    fp16: bool = _f(False, "fp16 parameters and compute with loss scaling")
    loss_scale: Optional[float] = _f(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = _f(2.0 ** 32, "first dynamic loss scale for fp16")
    fp8_format: Optional[str] = _f(None, "FP8 GEMMs in every hidden linear (QKV, projection, MLP, experts; the output "
                                         "layer stays in the run's precision): e4m3 everywhere, or hybrid (e4m3 "
                                         "forward, e5m2 gradients); the rest runs at --bf16/--fp16/fp32",
                                   choices=FP8_FORMATS)
    fp8_recipe: str = _f("delayed", "FP8 scaling: tensorwise (each tensor's amax now), delayed (from the amax "
                                    "history), blockwise (1x128 activation and 128x128 weight tiles)",
                         choices=FP8_RECIPES + FP8_BLACKWELL_RECIPES)
    fp8_margin: int = _f(0, "FP8: scale down by 2^margin below the format's maximum")
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling: steps of amax history kept per tensor")
    fp8_amax_compute_algo: str = _f("most_recent", "FP8 delayed scaling: the history's max or its most recent amax",
                                    choices=FP8_AMAX_ALGOS)
    fp8_param_gather: bool = _f(False, "FP8: the sharded weights' all-gathers move the FP8 linears' and routed "
                                       "experts' weights as their FP8 codes (tensorwise, delayed; optim, "
                                       "optim_grads, optim_grads_params)")
    fp8_output_layer: bool = _f(False, "FP8: the output layer's GEMMs in FP8 too, with the hidden linears' recipe "
                                       "(off by default, as in Megatron-LM and torchtitan: it is a fifth of a 1B "
                                       "Llama's GEMM work at a 128k vocabulary; its gradient in FP8 is coarser)",
                                megatron=OWN)
    gradient_accumulation_fusion: bool = _f(True, "on CUDA, add each linear's weight gradient into its fp32 gradient "
                                                  "by the matrix product itself (bf16/fp16 weight gradients are then "
                                                  "summed unrounded); the CPU never fuses")
    hysteresis: int = _f(2, "fp16: overflowing steps before the dynamic scale halves")
    seed: int = _f(1234, "random seed for weights, data order and dropout")
    device: str = _f("auto", "auto: cuda when GPUs are visible, else cpu (nccl and gloo by default; see "
                                 "--distributed-backend)", choices=("auto", "cuda", "cpu"), megatron=OWN)


@dataclass
class OptimizerConfig:
    lr: float = _f(3e-4, "peak learning rate", megatron=MEGATRON_REQUIRED)
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    decoupled_lr: Optional[float] = _f(None, "peak LR of the word embedding and the output layer, on a schedule of "
                                             "their own of the same shape (default: --lr)")
    decoupled_min_lr: Optional[float] = _f(None, "with --decoupled-lr: their LR at the end of decay (default: "
                                                 "--min-lr)")
    lr_decay_style: str = _f("linear", "decay after warm-up (WSD: Megatron-LM's spelling of wsd)",
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
    optimizer: str = _f("adam", "adam: AdamW (decoupled weight decay) for every parameter; muon: Muon for the hidden "
                                "layers' weight matrices (momentum orthogonalised by a Newton-Schulz iteration), "
                                "--muon-scalar-optimizer for the embeddings, output layer, norms, biases and routers",
                        choices=OPTIMIZERS)
    weight_decay: float = _f(0.01, "decoupled weight decay of the matrices (AdamW's and Muon's)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    muon_momentum: float = _f(0.9, "Muon: the momentum's decay (an exponential moving average of the gradients)")
    muon_nesterov: bool = _f(False, "Muon: orthogonalise the Nesterov look-ahead (gradient moved toward the "
                                    "momentum) instead of the momentum", aliases=("--muon-use-nesterov",))
    muon_num_ns_steps: int = _f(5, "Muon: Newton-Schulz iterations per matrix and step")
    muon_coefficient_type: str = _f("quintic", "Muon: the Newton-Schulz coefficients: quintic, Megatron-Core's "
                                               "schedule of five (a, b, c); simple, (3.4445, -4.775, 2.0315) at every "
                                               "step (torch.optim.Muon's)", choices=tuple(MUON_COEFFICIENTS), megatron=OWN)
    muon_scale_mode: str = _f("spectral", "Muon: the update's scale for an out x in matrix: spectral "
                                          "sqrt(max(out, in)), unit_rms_norm sqrt(out/in), shape_scaling "
                                          "sqrt(max(1, out/in))", choices=MUON_SCALE_MODES)
    muon_extra_scale_factor: float = _f(1.0, "Muon: one more factor on every update (0.2 matches AdamW's update "
                                             "RMS with --muon-scale-mode spectral)")
    muon_fp32_matmul_prec: str = _f("medium", "Muon: the Newton-Schulz matmuls in bf16 (medium, low) or fp32 (high: "
                                              "TF32 where torch allows it)", choices=MUON_MATMUL_PRECISIONS)
    muon_tp_mode: str = _f("blockwise", "Muon under tp: blockwise orthogonalises each rank's shard (the update "
                                        "depends on tp); duplicated gathers every matrix on every tp rank; "
                                        "distributed gives each matrix to one tp rank and scatters the result",
                           choices=MUON_TP_MODES)
    muon_no_split_qkv: bool = _f(False, "Muon: orthogonalise the fused QKV weight as one matrix instead of its q, "
                                        "k and v blocks apart")
    muon_scalar_optimizer: str = _f("adam", "Muon: the optimizer of the parameters that are no hidden matrix "
                                            "(AdamW with the --adam-* flags)", choices=("adam",), megatron=OWN)
    clip_grad: float = _f(1.0, "clip the global gradient L2 norm to this (0: off)")
    z_loss_weight: float = _f(0.0, "weight of the log-sum-exp auxiliary loss on the logits", megatron=OWN)

    def decoupled_floor(self) -> float:
        """The embedding and output layer's LR at the end of decay: --decoupled-min-lr, default --min-lr."""
        return self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr


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
    reset_attention_mask: bool = _f(False, "packed documents: each token attends only to the tokens of its own "
                                           "document, which the end-of-document token ends (Megatron-LM's)")
    reset_position_ids: bool = _f(False, "packed documents: positions restart at 0 after each end-of-document "
                                         "token (Megatron-LM's)")
    mock_data: bool = _f(False, "synthetic tokens that depend only on --seed and the sample index (a config "
                                "file's mock_data gives way to --data-path)")
    data_phases: Optional[list] = _f(None, "blend phases: a list of {start_iter, weights}", yaml_only=True, megatron=OWN)


@dataclass
class CheckpointConfig:
    save: Optional[str] = _f(None, "checkpoint directory to write")
    load: Optional[str] = _f(None, "checkpoint directory to resume from (default --save)")
    save_interval: Optional[int] = _f(None, "save every N iterations")
    async_save: bool = _f(False, "write checkpoints in the background")
    keep_last: Optional[int] = _f(None, "keep only the newest N checkpoints", megatron=OWN)
    keep_every: Optional[int] = _f(None, "also keep every checkpoint whose iteration is a multiple of N", megatron=OWN)
    ckpt_fallback: bool = _f(False, "if the newest checkpoint is damaged, load the newest complete one", megatron=OWN)
    no_load_optim: bool = _f(False, "load model weights only")
    finetune: bool = _f(False, "take only the model weights from --load: iteration 0, a fresh optimizer and data "
                               "position, no LR-schedule check (a restart resumes --save as usual)")
    pretrained_checkpoint: Optional[str] = _f(None, "checkpoint whose model weights start the run when --load and "
                                                    "--save hold none (as with --finetune)")
    override_opt_param_scheduler: bool = _f(False, "on resume, keep this run's LR schedule where the checkpoint's "
                                            "differs", aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = _f(False, "on resume, take the LR schedule the checkpoint was "
                                                  "trained with", aliases=("--use-checkpoint-opt_param-scheduler",))
    override_model_config: bool = _f(False, "on resume, train on with this run's model settings where they differ "
                                            "from the checkpoint's but keep every tensor's shape (e.g. "
                                            "--rotary-base, --moe-router-topk); each change is listed")
    exit_duration_in_mins: Optional[float] = _f(None, "save and exit after this many minutes")
    exit_interval: Optional[int] = _f(None, "save and exit after the first iteration that is a multiple of N")


@dataclass
class LoggingConfig:
    log_interval: int = _f(1, "iterations between console lines", megatron=100)
    eval_interval: Optional[int] = _f(None, "iterations between evaluations")
    eval_iters: int = _f(10, "validation batches per evaluation", megatron=100)
    tensorboard_dir: Optional[str] = _f(None, "TensorBoard event directory")
    metrics_file: Optional[str] = _f(None, "JSON-lines metrics (default <tensorboard-dir>/metrics.jsonl or <save>/metrics.jsonl)", megatron=OWN)
    peak_tflops: Optional[float] = _f(None, "device peak TFLOP/s for MFU (default from the device table)", megatron=OWN)
    pipeline_trace: Optional[str] = _f(None, "write each rank's forward/backward events to this file", megatron=OWN)
    profile: bool = _f(False, "record a torch.profiler trace")
    profile_step_start: int = _f(10, "first profiled iteration")
    profile_step_end: int = _f(12, "last profiled iteration")
    wandb_project: Optional[str] = _f(None, "also log the scalars to this Weights & Biases project (needs the "
                                            "wandb package; rank 0 logs)")
    wandb_exp_name: Optional[str] = _f(None, "the Weights & Biases run's name")
    wandb_save_dir: Optional[str] = _f(None, "where wandb keeps its local files")
    wandb_entity: Optional[str] = _f(None, "the Weights & Biases team or user")


@dataclass
class StabilityConfig:
    spike_window: int = _f(50, "iterations in the rolling loss window", megatron=OWN)
    spike_threshold: float = _f(6.0, "a loss above mean + K std of the window is a spike", megatron=OWN)
    spike_rollback_after: int = _f(0, "roll back after N spikes within the window (0: never)", megatron=OWN)
    spike_lr_factor: float = _f(0.5, "LR multiplier after a rollback", megatron=OWN)
    spike_lr_steps: int = _f(100, "iterations the lowered LR lasts", megatron=OWN)
    inject_fault: list = _f([], "KIND@ITER with KIND nan or spike (repeatable; for drills and tests)", action="append", megatron=OWN)

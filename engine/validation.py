"""Every check of a run's configuration that needs no process group, one function per section.

`validate(cfg, world_size)` runs them all; each failure is a line naming the flag, the value and the fix
(engine.config's `_err`), and one ConfigError holds every line. Rules that library code enforces again on its own
path are the public `check_*` functions (the topology, the pipeline and the planner call them) and
`parse_faults` (the fault drills read it), so each rule has one message. Files are read through engine/data.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

from engine.config import (CheckpointConfig, Config, ConfigError, LoggingConfig, ModelConfig, OptimizerConfig,
                           ParallelConfig, TrainingConfig, _err)
from engine.config.fields import FP8_BLACKWELL_RECIPES, MUON_COEFFICIENTS, Problems
from engine.data.build import check_data, check_document_ends, data_prefixes, document_flags, end_of_document
from engine.data.tokenizer_spec import data_vocab_size, tokenizer_of, vocab_source
from engine.flags import flag_of
from engine.layout import PipelineSchedule, Sharding
from engine.validation_model import at_least_one as _at_least_one, check_model

TP_FLAG, PP_FLAG, CP_FLAG = "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"
FAULT_KINDS = ("nan", "spike")  # --inject-fault drills


def validate(cfg: Config, world_size: int, problems: Optional[Problems] = None) -> None:
    """Every check that needs no process group, section by section. Each mistake is a line: in `problems` when
    given, else all raised together as one ConfigError. A check whose input an earlier one refused is left out
    (a world that is not tp x cp x pp x dp leaves no dp to check the batch against)."""
    own = problems is None
    problems = Problems() if own else problems
    check, par = problems.check, cfg.parallel
    model_ok = check(check_model, cfg.model)
    sizes_ok = check(_check_parallel_sizes, par)
    if sizes_ok and check(_check_pipeline_schedule, par, cfg.model.num_layers):
        schedule = PipelineSchedule.of(par.pipeline_schedule, cfg.pp, par.virtual_pipeline_model_parallel_size)
        if model_ok:
            check(_check_split, cfg.model, par, cfg.tp, cfg.pp, schedule.vpp)
        if check(_check_parallel, par, world_size):
            if model_ok:
                check(_check_moe, cfg.model, par, cfg.dp(world_size))
            check(_check_training, cfg.training, cfg.dp(world_size), cfg.pp,
                  schedule.vpp if schedule.interleaved else 1)
    if sizes_ok:
        check(check_fp8_param_gather, cfg.training, par)
    check(_check_optim, cfg.optim, cfg.training)
    check(_check_decoupled, cfg.optim)
    check(_check_logging, cfg.logging)
    check(_check_files, cfg)
    check(_check_checkpoint, cfg.checkpoint)
    check(check_spike_window, cfg.stability.spike_window)
    check(parse_faults, cfg.stability.inject_fault)
    if own:
        problems.raise_all()


def check_world_size(world_size: int, tp: int, pp: int, cp: int = 1) -> None:
    """The world must hold a whole number of tp x cp x pp model replicas (the dp size)."""
    if world_size % (tp * cp * pp):
        flag, value = (PP_FLAG, pp) if pp > 1 else (CP_FLAG, cp) if cp > 1 else (TP_FLAG, tp)
        sizes = f"tp {tp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "")
        _err(flag, value, f"{sizes} = {tp * cp * pp} does not divide the world size {world_size}; launch a "
                          f"multiple of {tp * cp * pp} processes or change --tp/--pp" + ("/--cp" if cp > 1 else ""))


def check_context_split(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Context parallelism cuts each sequence into 2 x cp equal chunks (two per CP rank, for equal causal
    work); sequence parallelism then splits each CP rank's part over tp."""
    if cp > 1 and seq_length % (2 * cp):
        _err("--seq-length", seq_length, f"must be divisible by 2 x --context-parallel-size {cp} = {2 * cp} "
                                         f"(each sequence is cut into {2 * cp} equal chunks); change one of them")
    if sequence_parallel and tp > 1 and seq_length % (tp * cp):
        what = f"tp {tp} x cp {cp} = {tp * cp}" if cp > 1 else f"tp {tp}"
        _err("--seq-length", seq_length, f"with --sequence-parallel it must be divisible by {what}")


def check_tp_fits_node(tp: int, gpus_per_node: Optional[int]) -> None:
    """A TP group talks in every layer, so it must stay within one node's fast links."""
    if gpus_per_node and (tp > gpus_per_node or gpus_per_node % tp):
        _err(TP_FLAG, tp, f"a TP group would span nodes (--gpus-per-node {gpus_per_node}); use a tp that divides it")


def check_interleaved_microbatches(pp: int, vpp: int, num_microbatches: int,
                                   flag: str = "--virtual-pipeline-model-parallel-size", value=None) -> None:
    """The interleaved schedule runs microbatches in groups of pp; `flag value` is what the caller blames."""
    if vpp > 1 and num_microbatches % pp:
        _err(flag, vpp if value is None else value,
             f"gives {num_microbatches} microbatches per step; the interleaved schedule (--vpp {vpp}) needs a "
             f"multiple of pp {pp}; change the batch size or --micro-batch-size, or drop --vpp")


def check_model_split(model: ModelConfig, tp: int, pp: int, tp_flag: str = TP_FLAG, pp_flag: str = PP_FLAG,
                      vpp: int = 1) -> None:
    """Heads, query groups and MLP width divide over tp ranks; layers divide evenly over pp stages x vpp chunks."""
    for name, size in (("--num-attention-heads", model.num_attention_heads),
                       ("--num-query-groups", model.resolved_query_groups()),
                       ("--ffn-hidden-size", model.resolved_ffn_hidden_size())):
        if size % tp:
            _err(tp_flag, tp, f"must divide {name} {size}; choose a tp among {_divisors(size)}")
    layers = model.num_layers
    if layers % pp:
        _err(pp_flag, pp, f"must divide --num-layers {layers}; choose a pp among {_divisors(layers)}")
    if layers % (pp * vpp):
        _err("--virtual-pipeline-model-parallel-size", vpp, f"must divide the {layers // pp} layers per stage "
             f"(--num-layers {layers} / pp {pp}); choose a vpp among {_divisors(layers // pp)}")


def check_spike_window(window: int) -> None:
    """The spike guard compares a loss with the mean and spread of the window, which needs two losses."""
    if window < 2:
        _err("--spike-window", window, "needs at least 2 iterations to measure a spread; use e.g. 50")


def _check_parallel_sizes(par: ParallelConfig) -> None:
    """First of all: every later check divides by these sizes."""
    _at_least_one(par, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "context_parallel_size")
    if par.cp_comm_type == "allgather":
        par.cp_comm_type = "all_gather"  # Megatron-LM's spelling
    _check_sharding_strategy(par)
    vpp = par.virtual_pipeline_model_parallel_size
    if (vpp or 1) > 1 and par.pipeline_model_parallel_size < 2:
        _err("--virtual-pipeline-model-parallel-size", vpp, "needs --pipeline-model-parallel-size of at least 2")


def _check_sharding_strategy(par: ParallelConfig) -> None:
    """--use-distributed-optimizer is the strategy `optim`: the two flags may not disagree; afterwards both
    say the same (the flag names the strategy, the boolean says whether anything is sharded)."""
    flag = "--data-parallel-sharding-strategy"
    given = par.data_parallel_sharding_strategy
    if par.use_distributed_optimizer and given is not None and not Sharding.of(given).optimizer:
        _err(flag, given, "contradicts --use-distributed-optimizer (which is the strategy optim); drop one")
    sharding = Sharding.of(par.data_parallel_sharding_strategy, par.use_distributed_optimizer)
    par.data_parallel_sharding_strategy, par.use_distributed_optimizer = sharding.strategy, sharding.optimizer
    if par.overlap_param_gather and not sharding.optimizer:
        _err("--overlap-param-gather", True, "overlaps the gathering of sharded weights, and nothing is sharded; "
                                             f"add --use-distributed-optimizer or {flag}, or drop it")


def check_fp8_param_gather(tr: TrainingConfig, par: ParallelConfig) -> None:
    """--fp8-param-gather gathers the sharded weights as one-scale FP8 codes (the distributed optimizer's step
    under ZeRO-1/2, the unit gathers under ZeRO-3)."""
    flag = "--fp8-param-gather"
    if not tr.fp8_param_gather:
        return
    if tr.fp8_format is None:
        _err(flag, True, "gathers the FP8 layers' weights, and nothing runs in FP8; add --fp8-format or drop it")
    elif tr.fp8_recipe not in ("tensorwise", "delayed"):
        _err(flag, True, f"takes one scale per weight (tensorwise or delayed), not --fp8-recipe {tr.fp8_recipe}; "
                         "drop one")
    strategy = par.data_parallel_sharding_strategy
    if not Sharding.of(strategy).optimizer:
        _err(flag, True, "is the distributed optimizer's weight all-gather, and nothing is sharded; add "
                         "--use-distributed-optimizer (or --data-parallel-sharding-strategy optim_grads) or drop it")


def _check_pipeline_schedule(par: ParallelConfig, layers: int) -> None:
    """--pipeline-schedule against --pp and --vpp: a schedule that runs a fixed number of chunks per rank takes
    no other --vpp, one that interleaves needs at least two, a split backward needs stages to overlap, and
    equal chunks refuse an uneven split (engine.layout.SCHEDULE_KINDS says which is which)."""
    if par.pipeline_schedule is None:
        return
    name, pp, vpp = par.pipeline_schedule, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    kind, flag = PipelineSchedule.of(name, pp).kind, "--pipeline-schedule"
    if kind.chunks == 1 and (vpp or 1) > 1:
        _err(flag, name, f"runs one model chunk per rank, but --vpp is {vpp}; drop --vpp or use {kind.instead}")
    if kind.chunks is None and (vpp or 1) < 2:
        _err(flag, name, "needs --virtual-pipeline-model-parallel-size of at least 2 (model chunks per rank)")
    if (kind.chunks or 1) > 1 and vpp not in (None, kind.chunks):
        _err(flag, name, f"places exactly {kind.chunks} model chunks per rank ({kind.shape}), not --vpp {vpp}; drop "
                         f"--vpp or give {kind.chunks}")
    if kind.split_backward and pp < 2:
        _err(flag, name, "needs --pipeline-model-parallel-size of at least 2; drop the flag for pp 1")
    uneven = par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None
    if (kind.chunks or 1) > 1 and uneven:
        _err(flag, name, f"splits the layers into {kind.chunks} x pp equal chunks; drop --decoder-first/last-"
                         f"pipeline-num-layers or use {kind.instead}")
    if (kind.chunks or 1) > 1 and layers % (kind.chunks * pp):
        _err(flag, name, f"needs --num-layers {layers} divisible by {kind.chunks} x pp = {kind.chunks * pp} "
                         f"({kind.chunks} equal chunks per rank); change --num-layers or --pp")


def _check_split(m: ModelConfig, par: ParallelConfig, tp: int, pp: int, vpp: int) -> None:
    """The model over tp ranks and pp stages: evenly, or with a given first/last stage size."""
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    uneven = first is not None or last is not None
    check_model_split(m, tp, 1 if uneven else pp, vpp=1 if uneven else vpp)  # uneven stages: their own rule below
    check_context_split(m.seq_length, par.context_parallel_size, tp, par.sequence_parallel)
    if par.context_parallel_size > 1 and m.attention_backend == "flash":
        _err("--attention-backend", "flash", "context parallelism merges attention blocks by their log-sum-exp, "
                                             "which Ternion takes from its own kernels; use auto or triton")
    if uneven:
        _check_pipeline_split(m.num_layers, first, last, pp, vpp)


def _check_pipeline_split(layers: int, first: Optional[int], last: Optional[int], pp: int, vpp: int) -> None:
    """--decoder-first/last-pipeline-num-layers: the stages in between share the rest evenly."""
    if vpp > 1:
        _err("--decoder-first-pipeline-num-layers", first, "uneven stages cannot be combined with --vpp")
    if pp < 2:
        _err("--decoder-first-pipeline-num-layers", first, "uneven stages need --pipeline-model-parallel-size >= 2")
    rest = layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest // middle < 1)):
        _err("--decoder-first-pipeline-num-layers", first,
             f"with --decoder-last-pipeline-num-layers {last} the remaining {rest} of {layers} layers "
             f"cannot be split evenly over {middle} middle stages")


def _check_parallel(par: ParallelConfig, world_size: int) -> None:
    check_world_size(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                     par.context_parallel_size)
    check_tp_fits_node(par.tensor_model_parallel_size, par.gpus_per_node)
    if par.distributed_timeout_minutes <= 0:
        _err("--distributed-timeout-minutes", par.distributed_timeout_minutes, "must be positive (e.g. 10)")


def _check_moe(m: ModelConfig, par: ParallelConfig, dp: int) -> None:
    """Experts: how many, how routed, and how split over expert-parallel ranks carved from dp."""
    ep, tp = par.expert_model_parallel_size, par.tensor_model_parallel_size
    _at_least_one(par, "expert_model_parallel_size")
    if not m.num_experts:
        if m.num_experts is not None or ep > 1:
            _err("--num-experts" if m.num_experts is not None else "--expert-model-parallel-size",
                 m.num_experts if m.num_experts is not None else ep, "expert parallelism needs --num-experts N >= 1")
        return
    _at_least_one(m, "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
    if m.moe_router_topk > m.num_experts:
        _err("--moe-router-topk", m.moe_router_topk, f"must be at most --num-experts {m.num_experts}")
    if dp % ep or m.num_experts % ep:
        _err("--expert-model-parallel-size", ep, f"must divide the data-parallel size {dp} and --num-experts "
                                                 f"{m.num_experts} (expert ranks are carved from dp)")
    if tp > 1 and not par.sequence_parallel:
        _err("--tensor-model-parallel-size", tp, "with --num-experts, tp > 1 needs --sequence-parallel (each tp rank "
                                                 "routes its own part of the sequence); add it")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        _err("--moe-expert-capacity-factor", m.moe_expert_capacity_factor, "must be positive (omit it: dropless)")
    if not m.moe_layers():
        _err("--moe-layer-freq", m.moe_layer_freq, "makes no layer an MoE layer; drop --num-experts or mark one")


def _check_training(tr: TrainingConfig, dp: int, pp: int, vpp: int) -> None:
    """Batch sizes in whole microbatches for every dp rank (and pp-sized groups when interleaved); one precision."""
    _at_least_one(tr, "micro_batch_size", "train_iters", "train_samples", "fp8_amax_history_len")
    per_step = tr.micro_batch_size * dp
    gbs = tr.global_batch_size or per_step
    if tr.train_samples is not None and not tr.rampup_batch_size and tr.train_samples < gbs:
        _err("--train-samples", tr.train_samples, f"is less than one global batch ({gbs}); the run would take no step")
    if gbs % per_step:
        _err("--global-batch-size", gbs,
             f"must be a multiple of --micro-batch-size {tr.micro_batch_size} x dp {dp} = {per_step}")
    sizes = [("--global-batch-size", gbs)]
    if tr.rampup_batch_size:
        start, incr, _ = tr.rampup_batch_size
        if min(start, incr) < 1:
            _err("--rampup-batch-size", " ".join(map(str, tr.rampup_batch_size)), "START and INCR must be at least 1")
        if start % per_step or incr % per_step or (gbs - start) % max(incr, 1):
            _err("--rampup-batch-size", " ".join(map(str, tr.rampup_batch_size)),
                 f"START and INCR must be multiples of micro x dp = {per_step} and reach --global-batch-size {gbs}")
        sizes += [("--rampup-batch-size", start), ("--rampup-batch-size", incr)]
    for flag, size in sizes:
        check_interleaved_microbatches(pp, vpp, size // per_step, flag, size)
    if tr.bf16 and tr.fp16:
        _err("--bf16", "with --fp16", "choose one precision")
    if tr.fp8_recipe in FP8_BLACKWELL_RECIPES:
        _err("--fp8-recipe", tr.fp8_recipe, "needs Blackwell tensor cores; use tensorwise, delayed or blockwise")
    if tr.fp8_output_layer and tr.fp8_format is None:
        _err("--fp8-output-layer", True, "puts the output layer's GEMMs in FP8, and nothing runs in FP8; add "
                                         "--fp8-format or drop it")


def _check_optim(opt: OptimizerConfig, tr: Optional[TrainingConfig] = None) -> None:
    unit = "samples" if tr is not None and tr.train_samples is not None else "iters"
    _check_schedule_unit(opt, unit)
    if opt.lr_decay_style.lower() == "wsd" and not getattr(opt, f"lr_wsd_decay_{unit}"):
        _err("--lr-decay-style", "wsd", f"also give --lr-wsd-decay-{unit} (length of the final decay)")
    if opt.min_lr > opt.lr:
        _err("--min-lr", opt.min_lr, f"must not exceed --lr {opt.lr}")
    if not 0 <= opt.lr_warmup_init <= opt.lr:
        _err("--lr-warmup-init", opt.lr_warmup_init, f"must be between 0 and --lr {opt.lr}")
    if opt.lr_warmup_fraction is not None and not 0 <= opt.lr_warmup_fraction < 1:
        _err("--lr-warmup-fraction", opt.lr_warmup_fraction, "must be at least 0 and below 1 (e.g. 0.01)")
    if opt.optimizer == "muon":
        _check_muon(opt)


def _check_decoupled(opt: OptimizerConfig) -> None:
    """--decoupled-min-lr needs --decoupled-lr (Megatron-LM would ignore it) and may not exceed it."""
    if opt.decoupled_min_lr is not None and opt.decoupled_lr is None:
        raise ConfigError(f"--decoupled-min-lr {opt.decoupled_min_lr}: applies with --decoupled-lr only; give "
                          "--decoupled-lr (the embedding and output layer's peak LR) or drop it")
    if opt.decoupled_lr is not None and not 0 <= opt.decoupled_floor() <= opt.decoupled_lr:
        raise ConfigError(f"--decoupled-lr {opt.decoupled_lr}: must be at least its minimum, --decoupled-min-lr or "
                          f"--min-lr ({opt.decoupled_floor()})")


def _check_muon(opt: OptimizerConfig) -> None:
    """Megatron-Core's rule: a schedule of k coefficient sets runs a positive multiple of k steps."""
    sets, steps = MUON_COEFFICIENTS[opt.muon_coefficient_type], opt.muon_num_ns_steps
    if steps < 1 or steps % sets:
        _err("--muon-num-ns-steps", steps, f"must be a positive multiple of the {sets} coefficient sets of "
             f"--muon-coefficient-type {opt.muon_coefficient_type} (e.g. {sets}, or use simple)")
    if not 0 <= opt.muon_momentum < 1:
        _err("--muon-momentum", opt.muon_momentum, "must be at least 0 and below 1 (e.g. 0.95)")


def _check_schedule_unit(opt: OptimizerConfig, unit: str) -> None:
    """Megatron-LM's rule: a --train-samples run gives its LR lengths in samples, a --train-iters run in
    iterations; the warm-up is a length or --lr-warmup-fraction, not both."""
    other = "iters" if unit == "samples" else "samples"
    for name in (f"lr_decay_{other}", f"lr_wsd_decay_{other}", f"lr_warmup_{other}"):
        if getattr(opt, name):
            instead = flag_of(name)[:-len(other)] + unit
            _err(flag_of(name), getattr(opt, name),
                 f"a --train-samples run counts its schedule in samples: use {instead}" if unit == "samples" else
                 f"is for a --train-samples run; add --train-samples, or use {instead} with --train-iters")
    if opt.lr_warmup_fraction is not None and getattr(opt, f"lr_warmup_{unit}"):
        _err("--lr-warmup-fraction", opt.lr_warmup_fraction, f"give it or --lr-warmup-{unit}, not both")
    _at_least_one(opt, "lr_decay_samples", "lr_wsd_decay_samples")


def _check_logging(lg: LoggingConfig) -> None:
    if lg.profile and not lg.tensorboard_dir:
        _err("--profile", "without --tensorboard-dir", "add --tensorboard-dir DIR: the trace is written there")
    if lg.profile and not 1 <= lg.profile_step_start <= lg.profile_step_end:
        _err("--profile-step-start", lg.profile_step_start,
             f"must be at least 1 and at most --profile-step-end {lg.profile_step_end}")
    if lg.wandb_project and importlib.util.find_spec("wandb") is None:
        _err("--wandb-project", lg.wandb_project, "the wandb package is not installed here: pip install wandb, or drop "
                                                  "the flag (--tensorboard-dir and --metrics-file keep the same scalars)")


def _check_files(cfg: Config) -> None:
    d = cfg.data
    tokenizer_of(cfg)  # the tokenizer flags fit together and name files that exist, mock data or not
    if d.data_path:
        for _, prefix in data_prefixes(d.data_path):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    _err("--data-path", prefix,
                         f"{prefix + ext} not found; give the prefix without .bin/.idx, made by tools/preprocess_data.py")
    if not d.data_path and not d.mock_data:
        _err("--data-path", "(none)", "give --data-path PREFIX or use --mock-data")
    for flag in document_flags(d):
        if d.mock_data:
            _err(flag, "with --mock-data", "synthetic tokens have no end-of-document token; drop one of them")
    if d.data_path and not d.mock_data:  # opens each index: empty data, ids past the vocabulary
        check_data(d.data_path, data_vocab_size(cfg), vocab_source(cfg))
        resets = [f for f in document_flags(d) if f != "--eod-mask-loss"]
        if resets:  # the documents must end with the tokenizer's end-of-document token
            check_document_ends(d.data_path, end_of_document(cfg), resets[0])
    ck = cfg.checkpoint  # Megatron-LM's --save X --load X: the first run of the job makes X
    first_of_job = ck.save and os.path.abspath(ck.load or "") == os.path.abspath(ck.save)
    if ck.load and not os.path.isdir(ck.load) and not first_of_job:
        _err("--load", ck.load, "directory not found; check the path or drop --load")


def _check_checkpoint(ck: CheckpointConfig) -> None:
    if ck.override_opt_param_scheduler and ck.use_checkpoint_opt_param_scheduler:
        _err("--override-opt-param-scheduler", "with --use-checkpoint-opt-param-scheduler",
             "they contradict each other: keep this run's LR schedule or the checkpoint's, not both")
    if ck.load and os.path.isfile(ck.load):
        _err("--load", ck.load, "is a file; give the --save directory of a run (or one of its iter_NNNNNNN folders)")
    if ck.pretrained_checkpoint and not os.path.isdir(ck.pretrained_checkpoint):
        _err("--pretrained-checkpoint", ck.pretrained_checkpoint, "directory not found; give a checkpoint directory "
                                                                  "(e.g. made by tools/convert_hf.py)")
    if ck.finetune and not (ck.load or ck.pretrained_checkpoint):
        _err("--finetune", "without --load", "give --load DIR (or --pretrained-checkpoint DIR): the checkpoint whose "
                                             "weights to start from")


def parse_faults(specs: list) -> dict:
    """["nan@20", "spike@40"] -> {20: "nan", 40: "spike"}: the --inject-fault drills (engine.stability.FaultDrill).
    Raises ConfigError naming a bad spec."""
    faults: dict = {}
    for spec in specs or []:
        kind, _, it = str(spec).partition("@")
        if kind not in FAULT_KINDS or not it.isdigit() or int(it) < 1:
            raise ConfigError(f"--inject-fault {spec}: use nan@ITER or spike@ITER (ITER a positive integer)")
        if int(it) in faults:
            raise ConfigError(f"--inject-fault {spec}: iteration {it} already has a fault; use one per iteration")
        faults[int(it)] = kind
    return faults


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

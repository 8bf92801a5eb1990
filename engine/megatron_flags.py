"""Megatron-LM flags that are not Ternion config fields, and what each one does here: one table, one rule each.

A Megatron-LM command line runs as it is. Its flags that are Ternion fields too (`--num-layers`, `--lr`, ...)
are the config's own; the rest are in `FLAGS`, each of one kind:

- MEANING: accepted with Megatron-LM's meaning; `apply` turns it into Ternion config values (e.g.
  `--recompute-activations` is `--recompute-granularity selective`), or refuses a value Ternion cannot honour.
- IMPLEMENTATION: it only picks one of Megatron-LM's implementations (kernels, checkpoint format);
  accepted, and all of them are named in one `note:` line.
- ALREADY: asks for what Ternion always does; accepted, named in one `note:` line.
- NOT_DONE: logging or housekeeping Ternion does not do; training is the same, so accepted and named in one
  `note:` line.
- REFUSED: a concept Ternion does not have. The flag stays unknown to the parser, which answers it with one
  line: what it is, that Ternion does not do it, what to use instead.

engine/cli.py hooks this in with `add_flags` (the parser), `refusals` (the parser's lines for refused
flags) and `translate` (after parsing: Megatron values -> config values, and the notes the launcher prints
once from rank 0). Spellings of values that differ (`--lr-decay-style WSD`, `--attention-backend fused`)
are settled in `translate` as well.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from engine.config import ConfigError
from engine.flags import FIELDS, default_of, flag_of

MEANING, IMPLEMENTATION, ALREADY, NOT_DONE, REFUSED = "meaning", "implementation", "already", "not done", "refused"
DEST = "megatron:"  # argparse dest prefix: never a config field name


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str
    text: str                         # help / the note's reason / the refusal line
    type: Optional[Callable] = None   # None: a switch
    choices: tuple = ()
    apply: Optional[Callable] = None  # MEANING: (value, values) -> an extra note line or None; may raise


def _get(values: dict, name: str):
    """A config value as it will be: given (flag or YAML), else the field's default."""
    return values[name] if name in values else default_of(FIELDS[name])


# ---------------------------------------------------------------- MEANING: what each flag sets
def _group_query_attention(_, values):
    values.setdefault("num_query_groups", 1)  # Megatron-LM's --num-query-groups default: one group


def _rotary(_, values):
    values["position_embedding_type"] = "rope"


def _no_position_embedding(_, values):
    if _get(values, "position_embedding_type") != "rope":
        raise ConfigError("--no-position-embedding: a model without position encoding (NoPE) is not built here, and "
                          "Megatron-LM refuses it without rope too; use --position-embedding-type rope")


def _rotary_percent(value, _):
    if value != 1.0:
        raise ConfigError(f"--rotary-percent {value}: rotary embeddings on part of each head are not implemented "
                          "here; use 1.0 (RoPE on the whole head)")


def _recompute_activations(_, values):
    values["recompute_granularity"] = "selective"


def _recompute_method(value, values):
    granularity = values.get("recompute_granularity")
    if granularity == "selective":
        raise ConfigError(f"--recompute-method {value}: applies to --recompute-granularity full only (selective "
                          "recomputes the attention core of every layer); drop one of them")
    if granularity != "full":
        return f"--recompute-method {value} does nothing without --recompute-granularity full (as in Megatron-LM)"
    if value == "uniform":  # every layer recomputed; Ternion's --recompute-num-layers is the block method's count
        group = values.pop("recompute_num_layers", None)
        if group and group > 1:
            return (f"--recompute-method uniform --recompute-num-layers {group}: every layer is recomputed, each "
                    f"from its own input rather than in groups of {group} (the same numbers, a little more memory)")
    return None


def _layers_per_virtual_stage(value, values):
    if "virtual_pipeline_model_parallel_size" in values:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage: give it or --virtual-pipeline-model-parallel-size, "
                          "not both")
    layers, pp = _get(values, "num_layers"), _get(values, "pipeline_model_parallel_size")
    if value < 1 or layers % pp or (layers // pp) % value:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {value}: must divide the {layers / pp:g} layers "
                          f"per pipeline stage (--num-layers {layers} / pp {pp})")
    values["virtual_pipeline_model_parallel_size"] = layers // pp // value


def _dataloader_type(value, _):
    if value != "single":
        raise ConfigError(f"--dataloader-type {value}: only Megatron-LM's pretraining order (single) is implemented; "
                          "drop the flag or use single")


def _tensorboard_log_interval(value, _):
    if value != 1:
        return f"--tensorboard-log-interval {value}: TensorBoard gets every iteration here"
    return None


def _expert_tensor_parallel(value, _):
    if value != 1:
        raise ConfigError(f"--expert-tensor-parallel-size {value}: experts are not split over tp here (each tp rank "
                          "routes its own tokens under --sequence-parallel); use 1 or drop it")


def _meaning(name, text, apply, value_type=None, choices=()):
    return Flag(name, MEANING, text, value_type, choices, apply)


_FUSION, _CKPT = "kernel fusion", "Ternion's own format, loadable at any layout"
_PER_SPLIT = "separate datasets per split are not supported; give --data-path and --split (e.g. --split 949,50,1)"
FLAGS = (
    # accepted with Megatron-LM's meaning
    _meaning("--group-query-attention", "grouped-query attention; --num-query-groups defaults to 1 with it",
             _group_query_attention),
    _meaning("--use-rotary-position-embeddings", "= --position-embedding-type rope", _rotary),
    _meaning("--no-position-embedding", "no learned position table (with rope: nothing to drop)",
             _no_position_embedding),
    _meaning("--rotary-percent", "fraction of each head that RoPE rotates (1.0 only)", _rotary_percent, float),
    _meaning("--recompute-activations", "= --recompute-granularity selective", _recompute_activations),
    _meaning("--recompute-method", "with --recompute-granularity full: block recomputes --recompute-num-layers "
                                   "layers per stage, uniform all of them", _recompute_method, str,
             ("uniform", "block")),
    _meaning("--num-layers-per-virtual-pipeline-stage", "sets --virtual-pipeline-model-parallel-size to "
                                                        "layers / pp / N", _layers_per_virtual_stage, int),
    _meaning("--dataloader-type", "single (Megatron-LM's pretraining order) only", _dataloader_type, str,
             ("single", "cyclic", "external")),
    _meaning("--tensorboard-log-interval", "TensorBoard gets every iteration", _tensorboard_log_interval, int),
    # only choose among Megatron-LM's implementations
    Flag("--use-mcore-models", IMPLEMENTATION, "one model implementation"),
    Flag("--use-legacy-models", IMPLEMENTATION, "one model implementation"),
    Flag("--transformer-impl", IMPLEMENTATION, "", str, ("local", "transformer_engine", "inference_optimized")),
    Flag("--use-flash-attn", IMPLEMENTATION, "--attention-backend auto picks flash attention where it can"),
    Flag("--no-masked-softmax-fusion", IMPLEMENTATION, _FUSION),
    Flag("--no-bias-gelu-fusion", IMPLEMENTATION, _FUSION),
    Flag("--no-bias-swiglu-fusion", IMPLEMENTATION, _FUSION),
    Flag("--no-bias-dropout-fusion", IMPLEMENTATION, _FUSION),
    Flag("--no-rope-fusion", IMPLEMENTATION, _FUSION),
    Flag("--no-persist-layer-norm", IMPLEMENTATION, _FUSION),
    Flag("--cross-entropy-loss-fusion", IMPLEMENTATION, _FUSION),
    Flag("--ckpt-format", IMPLEMENTATION, _CKPT, str, ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor", "zarr")),
    Flag("--use-dist-ckpt", IMPLEMENTATION, _CKPT),
    Flag("--auto-detect-ckpt-format", IMPLEMENTATION, "one format"),
    Flag("--ckpt-fully-parallel-save", IMPLEMENTATION, "every rank writes its own shards"),
    Flag("--ckpt-fully-parallel-load", IMPLEMENTATION, "every rank reads its own shards"),
    Flag("--tp-comm-overlap", IMPLEMENTATION, "communication/GEMM overlap"),
    Flag("--use-megatron-fsdp", IMPLEMENTATION, "sharded data parallelism runs on the engine's own grad buffer; "
                                                "--data-parallel-sharding-strategy says what is sharded"),
    Flag("--moe-grouped-gemm", IMPLEMENTATION, "experts run as one grouped GEMM wherever torch has one"),
    Flag("--moe-use-legacy-grouped-gemm", IMPLEMENTATION, "one grouped GEMM"),
    Flag("--moe-permute-fusion", IMPLEMENTATION, "token permutation"),
    Flag("--moe-token-dispatcher-type", IMPLEMENTATION, "tokens travel by all-to-all over the EP group", str,
         ("allgather", "alltoall", "flex")),
    Flag("--grad-reduce-in-bf16", IMPLEMENTATION, "gradients are reduced in fp32"),
    Flag("--no-create-attention-mask-in-dataloader", IMPLEMENTATION, "no mask tensors are made: causal attention"),
    Flag("--no-mmap-bin-files", IMPLEMENTATION, ".bin files are memory-mapped"),
    Flag("--use-cpu-initialization", IMPLEMENTATION, "weights are the same on every layout"),
    Flag("--apply-layernorm-1p", IMPLEMENTATION, "Megatron-LM keeps norm weights as w - 1; the function and the "
                                                 "updates are the same, as norm weights get no weight decay"),
    Flag("--manual-gc", IMPLEMENTATION, "Python garbage collection"),
    Flag("--manual-gc-interval", IMPLEMENTATION, "Python garbage collection", int),
    Flag("--empty-unused-memory-level", IMPLEMENTATION, "CUDA cache release", int, (0, 1, 2)),
    Flag("--timing-log-level", IMPLEMENTATION, "timers", int, (0, 1, 2)),
    Flag("--timing-log-option", IMPLEMENTATION, "timers", str, ("max", "minmax", "all")),
    # what Ternion always does
    Flag("--exit-signal-handler", ALREADY, "SIGTERM, SIGUSR1 and SIGINT save and stop"),
    Flag("--log-throughput", ALREADY, "tokens/s and TFLOP/s per GPU in every log line"),
    Flag("--log-throughput-to-tensorboard", ALREADY, "tokens-per-sec, tflops-per-gpu"),
    Flag("--log-validation-ppl-to-tensorboard", ALREADY, "valid/ppl"),
    Flag("--log-memory-to-tensorboard", ALREADY, "mem-peak-gb on GPUs"),
    Flag("--log-l2-norm-grad-to-tensorboard", ALREADY, "grad-norm"),
    Flag("--attention-softmax-in-fp32", ALREADY, "softmax in fp32"),
    Flag("--accumulate-allreduce-grads-in-fp32", ALREADY, "gradients accumulate and reduce in fp32"),
    Flag("--calculate-per-token-loss", ALREADY, "the loss is the mean over every token of the global batch"),
    # logging and housekeeping Ternion does not do (training is the same)
    Flag("--log-params-norm", NOT_DONE, "not computed"),
    Flag("--log-num-zeros-in-grad", NOT_DONE, "not computed"),
    Flag("--log-timers-to-tensorboard", NOT_DONE, "no timers"),
    Flag("--log-world-size-to-tensorboard", NOT_DONE, "not written"),
    Flag("--log-progress", NOT_DONE, "no progress.txt"),
    Flag("--log-energy", NOT_DONE, "not measured"),
    Flag("--log-max-attention-logit", NOT_DONE, "not computed"),
    Flag("--log-runtime-to-tensorboard", NOT_DONE, "not written"),
    Flag("--log-device-memory-used", NOT_DONE, "not written"),
    Flag("--log-memory-interval", NOT_DONE, "peak memory is in every log line", int),
    Flag("--no-log-loss-scale-to-tensorboard", NOT_DONE, "loss-scale is always written"),
    Flag("--logging-level", NOT_DONE, "no Python logging", int),
    Flag("--tensorboard-queue-size", NOT_DONE, "TensorBoard's default queue", int),
    Flag("--num-workers", NOT_DONE, "samples are read in the training process", int),
    Flag("--data-cache-path", NOT_DONE, "sample indices are cached in cache/ beside each --data-path prefix", str),
    Flag("--no-load-rng", NOT_DONE, "the checkpoint's random state, which only dropout draws on, is restored"),
    Flag("--no-save-rng", NOT_DONE, "the random state is saved"),
    Flag("--no-save-optim", NOT_DONE, "the optimizer state is saved"),
    Flag("--tiktoken-pattern", NOT_DONE, "Megatron-LM's TikTokenizer only", str),
    # concepts Ternion does not have
    Flag("--squared-relu", REFUSED, "the squared-ReLU MLP is not implemented; use the GELU MLP (default) or --swiglu"),
    Flag("--rotary-interleaved", REFUSED, "interleaved rotary pairs (GPT-J style) are not implemented: RoPE rotates "
                                          "the two halves of each head (Llama style); drop it"),
    *(Flag(name, REFUSED, _PER_SPLIT) for name in ("--train-data-path", "--valid-data-path", "--test-data-path")),
    Flag("--step-batch-size-schedule", REFUSED, "batch sizes by consumed tokens (Megatron-LM after core 0.16) are not "
                                                "implemented; use --rampup-batch-size START INCR SAMPLES"),
    Flag("--use-checkpoint-args", REFUSED, "the model flags are not read from the checkpoint; pass those of the run "
                                           "that saved it (its metrics.args.json is a --config file holding all)"),
    Flag("--hierarchical-context-parallel-sizes", REFUSED, "context parallelism is one ring (or one all-gather) "
                                                           "over --context-parallel-size ranks; drop it"),
    _meaning("--expert-tensor-parallel-size", "1: experts are not split over tp (what Ternion does)",
             _expert_tensor_parallel, int),
    Flag("--moe-router-pre-softmax", REFUSED, "the softmax router takes the top-k of the softmax and renormalises "
                                              "them (Mixtral); un-renormalised pre-softmax weights are not implemented"),
    Flag("--moe-input-jitter-eps", REFUSED, "router input jitter is not implemented; drop it"),
    Flag("--moe-pad-expert-input-to-capacity", REFUSED, "expert inputs are not padded: dropped tokens are left out "
                                                        "and the grouped GEMM takes uneven groups; drop it"),
)
BY_NAME = {f.name: f for f in FLAGS}
_NOTE_HEADS = {IMPLEMENTATION: "Megatron-LM implementation choices, nothing to choose here (Ternion has one of each)",
               ALREADY: "accepted, Ternion always does this",
               NOT_DONE: "accepted, not done here (training is the same)"}
# Megatron-LM's spelling of a value -> Ternion's: (field, Megatron value, Ternion value, what to note or "")
SPELLINGS = (("lr_decay_style", "WSD", "wsd", ""),
             ("attention_backend", "fused", "auto", "cuDNN's fused kernel; auto picks the fastest kernel here"),
             ("attention_backend", "unfused", "local", "= local, the plain PyTorch attention here"))


def _dest(flag: Flag) -> str:
    return DEST + flag.name[2:]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Register the accepted flags (all but REFUSED) in a group of their own; a name the parser already
    knows (a config field) is left to it."""
    known = {s for a in parser._actions for s in a.option_strings}
    group = parser.add_argument_group("Megatron-LM flags (accepted; see engine/megatron_flags.py)")
    for flag in FLAGS:
        if flag.kind == REFUSED or flag.name in known:
            continue
        help = f"{flag.kind}: {flag.text}" if flag.text else flag.kind
        if flag.type is None:
            group.add_argument(flag.name, dest=_dest(flag), action="store_true", help=help)
        else:
            group.add_argument(flag.name, dest=_dest(flag), type=flag.type, choices=flag.choices or None,
                               metavar=None if flag.choices else flag.name[2:].upper().replace("-", "_"), help=help)


def refusals() -> dict:
    """The parser's one line for each refused flag (it stays unknown to argparse)."""
    return {f.name: f"{f.name}: {f.text}" for f in FLAGS if f.kind == REFUSED}


def translate(values: dict, problems: Optional[list] = None) -> list:
    """Take the Megatron-LM flags out of `values` (parsed flags and YAML keys by field name), set the config
    values they mean, settle Megatron spellings of values; return the notes to print (one line per kind). A flag
    whose value cannot be honoured is a line in `problems` (raised at once without it)."""
    given = [(BY_NAME["--" + key[len(DEST):]], values.pop(key)) for key in list(values) if key.startswith(DEST)]
    given.sort(key=lambda fv: FLAGS.index(fv[0]))  # table order: --use-rotary-... before --no-position-embedding
    lines, listed = [], {kind: [] for kind in _NOTE_HEADS}
    for flag, value in given:
        if flag.kind == MEANING:
            try:
                line = flag.apply(value, values)
            except ConfigError as e:
                if problems is None:
                    raise
                problems.append(str(e))
                continue
            lines += [line] if line else []
        else:
            shown = flag.name if flag.type is None else f"{flag.name} {value}"
            listed[flag.kind].append(f"{shown} ({flag.text})" if flag.text else shown)
    for name, megatron, ours, reason in SPELLINGS:
        if values.get(name) == megatron:
            values[name] = ours
            if reason:
                listed[IMPLEMENTATION].append(f"{flag_of(name)} {megatron} ({reason})")
    lines += [f"{_NOTE_HEADS[kind]}: {'; '.join(items)}" for kind, items in listed.items() if items]
    return lines

"""A Megatron-LM command line runs as it is (issue 15): two of its example scripts, flag for flag.

The command lines below are Megatron-LM's (core_v0.16.1) examples/gpt3/train_gpt3_175b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh with every flag kept, in their order. Only these change: the sizes
(a tiny model, a few iterations), the paths (a tmp dir) and the data, which is `--mock-data` (the Llama script's
own MOCK branch; the GPT-3 script's --data-path/--vocab-file/--merge-file give way to it). Each trains 3
iterations on CPU in one process, the LR of each step equal to Megatron-LM's formula in samples.

- GPT-3 175B: trains unchanged, --fp16 included (it works on CPU), ramp-up, --lr-warmup-fraction and the
  `--save X --load X` idiom with X not made yet.
- Llama 3 8B, with the script's DTYPE switch at bf16 (its fp8 branch's --fp8-param-gather stops a run with one
  line naming it: FP8 weight gathering is not implemented; docs/fp8.md): --decoupled-lr truly cannot be honoured (one LR schedule drives every parameter here), so the
  command stops with one line naming it; with --decoupled-lr and --decoupled-min-lr dropped it trains,
  --train-samples/--lr-decay-samples/--lr-warmup-samples included. --context-parallel-size 1 is passed once the
  parser knows it (the context-parallel issue adds it).

The smaller cases check the table in engine/megatron_flags.py: every refused flag gets its own line, the
accepted ones set Megatron-LM's meaning, and the notes come once.
"""
import json
import math

import pytest
from test_launcher import ERROR, launch, our_lines

from engine import megatron_flags
from engine.cli import build_parser, parse_config
from engine.config import ConfigError
from engine.resolve import resolve
from engine.validation import validate

KNOWN = {s for a in build_parser()._actions for s in a.option_strings}


def gpt3_175b(tmp):
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--attention-backend", "auto"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--rampup-batch-size", "2", "2", "4",
                "--train-iters", "3", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style",
                "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "3"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    data = ["--mock-data", "--split", "949,50,1"]
    logging = ["--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", f"{tmp}/ck",
               "--load", f"{tmp}/ck", "--eval-iters", "10", "--tensorboard-dir", f"{tmp}/tb"]
    return model + training + parallel + data + logging


def llama3_8b(tmp):
    model = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
             "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
             "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
             "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "12", "--lr-decay-samples",
                "11", "--lr-warmup-samples", "2", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
                "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay",
                "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
                "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
                "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235"]
    cp = ["--context-parallel-size", "1"] if "--context-parallel-size" in KNOWN else []
    parallel = ["--tensor-model-parallel-size", "1", *cp, "--sequence-parallel"]
    ddp = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    # the script passes "--split '99,1,0'" unquoted: the quotes reach the program (Megatron-LM reads the digits)
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--data-cache-path",
            f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]
    logging = ["--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
               "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
               "torch_dist", "--distributed-timeout-minutes", "60", "--save", f"{tmp}/ck", "--load", f"{tmp}/ck",
               "--tensorboard-dir", f"{tmp}/tb"]
    return model + training + ddp + parallel + data + logging


def without(args, *flags):
    """`args` without each of `flags` and its one value."""
    out, skip = [], False
    for a in args:
        if skip or a in flags:
            skip = not skip
            continue
        out.append(a)
    return out


def megatron_lr(step, lr, min_lr, warmup, decay):
    """Megatron-LM's cosine schedule at `step` samples (OptimizerParamScheduler.get_lr)."""
    if warmup > 0 and step <= warmup:
        return lr * float(step) / float(warmup)
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def train_records(path):
    return [r for r in map(json.loads, open(path)) if "event" not in r and "split" not in r]


def test_gpt3_175b_example_trains_unchanged(tmp_path):
    proc, _ = launch(gpt3_175b(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = train_records(tmp_path / "tb" / "metrics.jsonl")
    assert [r["consumed_samples"] for r in records] == [2, 4, 8]  # ramp-up 2 2 4 to the global batch 4
    # Iteration-based: decay 3 x 4 samples, warm-up .001 of it; the LR position is the samples consumed.
    assert [r["lr"] for r in records] == [megatron_lr(s, 6.0e-5, 6.0e-6, 0.001 * 12, 12) for s in (0, 2, 4)]
    assert records[-1]["loss_scale"] == 2.0 ** 16 and all(math.isfinite(r["lm_loss"]) for r in records)  # fp16
    assert "saved checkpoint at iteration 3" in proc.stdout and not our_lines(proc)


def test_llama3_8b_example_stops_on_decoupled_lr_and_trains_without_it(tmp_path):
    args = llama3_8b(tmp_path)
    proc, _ = launch(args, timeout=60)
    assert proc.returncode == 2 and our_lines(proc) == [
        f"{ERROR} --decoupled-lr: a separate LR for the embedding and output layers is not supported: one "
        "--lr/--min-lr schedule drives every parameter; drop it (python launch/pretrain_gpt.py --help)"], proc.stderr
    proc, _ = launch(without(args, "--decoupled-lr", "--decoupled-min-lr"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = train_records(tmp_path / "tb" / "metrics.jsonl")
    assert [r["consumed_samples"] for r in records] == [4, 8, 12]  # --train-samples 12 / global batch 4
    assert [r["lr"] for r in records] == [megatron_lr(s, 0.00015, 0.00001, 2, 11) for s in (0, 4, 8)]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("pretrain_gpt.py: note:")]
    assert len(notes) == 3, notes  # implementation choices, what Ternion always does, what it leaves out
    assert notes[0].startswith("pretrain_gpt.py: note: Megatron-LM implementation choices") and \
        "--use-mcore-models" in notes[0] and "--attention-backend fused" in notes[0]
    assert "--calculate-per-token-loss" in notes[1] and "--num-workers 1" in notes[2]
    assert "saved checkpoint at iteration 3" in proc.stdout


@pytest.mark.parametrize("flag", [f.name for f in megatron_flags.FLAGS if f.kind == megatron_flags.REFUSED])
def test_each_refused_flag_gets_its_own_line(flag):
    with pytest.raises(ConfigError) as info:
        parse_config(["--mock-data", flag, "1"])
    assert str(info.value) == f"{megatron_flags.BY_NAME[flag].name}: {megatron_flags.BY_NAME[flag].text} " \
                              "(python launch/pretrain_gpt.py --help)"


def _cfg(*args, world=1):
    cfg = parse_config(["--mock-data", *args])
    validate(cfg, world)
    return resolve(cfg, world)


def test_accepted_flags_set_megatrons_meaning():
    cfg = _cfg("--group-query-attention", "--use-rotary-position-embeddings", "--no-position-embedding",
               "--rotary-percent", "1.0", "--recompute-activations", "--lr-decay-style", "WSD",
               "--lr-wsd-decay-iters", "10", "--attention-backend", "unfused", "--dataloader-type", "single")
    m = cfg.model
    assert (m.num_query_groups, m.position_embedding_type, m.recompute_granularity) == (1, "rope", "selective")
    assert (cfg.optim.lr_decay_style, m.attention_backend) == ("wsd", "local")
    assert _cfg("--group-query-attention", "--num-query-groups", "2").model.num_query_groups == 2
    block = _cfg("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")
    assert block.model.recompute_num_layers == 1 and not block.notices
    uniform = _cfg("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2")
    assert uniform.model.recompute_num_layers is None and "every layer is recomputed" in uniform.notices[0]
    vpp = _cfg("--num-layers", "8", "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2",
               "--global-batch-size", "2", world=2)
    assert vpp.parallel.virtual_pipeline_model_parallel_size == 2
    samples = _cfg("--train-samples", "100", "--global-batch-size", "8", "--lr-warmup-fraction", "0.1")
    assert samples.training.train_iters == 12  # whole global batches, as Megatron-LM counts them
    _cfg("--expert-tensor-parallel-size", "1")  # experts not split over tp: what Ternion does


@pytest.mark.parametrize("args, line", [
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: rotary embeddings on part of each head are not implemented"),
    (["--no-position-embedding"], "--no-position-embedding: a model without position encoding (NoPE) is not built"),
    (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: only Megatron-LM's pretraining order (single)"),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd' (choose from 'adam', 'muon')"),
    (["--recompute-activations", "--recompute-method", "block"], "--recompute-method block: applies to "
                                                                 "--recompute-granularity full only"),
    (["--train-iters", "5", "--train-samples", "80"], "--train-iters with --train-samples: give the run's length in "
                                                      "one of them"),
    (["--train-samples", "80", "--lr-warmup-iters", "2"], "--lr-warmup-iters 2: a --train-samples run counts its "
                                                          "schedule in samples: use --lr-warmup-samples"),
    (["--lr-decay-samples", "80"], "--lr-decay-samples 80: is for a --train-samples run; add --train-samples, or use "
                                   "--lr-decay-iters with --train-iters"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction 0.1: give it or "
                                                                "--lr-warmup-iters, not both"),
    (["--train-samples", "80", "--lr-decay-style", "wsd"], "--lr-decay-style wsd: also give --lr-wsd-decay-samples"),
    (["--train-samples", "3", "--global-batch-size", "4"], "--train-samples 3: is less than one global batch (4)"),
    (["--lr-warmup-init", "1.0"], "--lr-warmup-init 1.0: must be between 0 and --lr"),
    (["--rampup-batch-size", "0", "4", "40"], "--rampup-batch-size 0 4 40: START and INCR must be at least 1"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2: experts are not split over tp here"),
])
def test_values_megatron_refuses_or_ternion_cannot_honour_end_in_one_line(args, line):
    with pytest.raises(ConfigError) as info:
        _cfg(*args)
    assert str(info.value).startswith(line), str(info.value)


def test_table_names_no_config_field_and_the_notes_come_once_per_kind():
    from engine.flags import FIELD_SECTION, flag_of
    fields = {flag_of(name) for name in FIELD_SECTION}
    assert not {f.name for f in megatron_flags.FLAGS} & fields  # one source for each flag
    cfg = parse_config(["--mock-data", "--use-flash-attn", "--transformer-impl", "transformer_engine",
                        "--exit-signal-handler", "--log-params-norm", "--log-num-zeros-in-grad", "--no-load-rng"])
    assert cfg.notices == [
        "Megatron-LM implementation choices, nothing to choose here (Ternion has one of each): --transformer-impl "
        "transformer_engine; --use-flash-attn (--attention-backend auto picks flash attention where it can)",
        "accepted, Ternion always does this: --exit-signal-handler (SIGTERM, SIGUSR1 and SIGINT save and stop)",
        "accepted, not done here (training is the same): --log-params-norm (not computed); --log-num-zeros-in-grad "
        "(not computed); --no-load-rng (the checkpoint's random state, which only dropout draws on, is restored)"]


def test_exit_interval_stops_at_the_first_multiple_with_megatron_meaning():
    from engine.cli import parse_config
    from engine.run.preemption import PreemptionHandler
    cfg = parse_config(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--exit-interval", "3"])
    handler = PreemptionHandler(signals=(), exit_interval=cfg.checkpoint.exit_interval)
    assert [handler.should_stop(i) for i in (1, 2)] == [False, False] and handler.reason is None
    assert handler.should_stop(3) and handler.reason == "--exit-interval 3"


def test_eod_mask_loss_drops_the_loss_on_the_token_after_each_end_of_document():
    import numpy as np
    import pytest

    from engine.cli import parse_config
    from engine.config import ConfigError
    from engine.data.batch import make_batch
    from engine.data.build import end_of_document
    from engine.validation import validate

    class Data(list):
        eod_mask = 9
    batch = make_batch(Data([np.array([1, 2, 9, 4, 5, 9, 7])]), [0])
    assert batch["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]  # inputs 9 predict the next document
    cfg = parse_config(["--config", "configs/gpt-tiny.yaml", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        "100", "--mock-data", "--eod-mask-loss"])
    assert end_of_document(cfg) == 100  # NullTokenizer: --vocab-size N ends documents with id N
    with pytest.raises(ConfigError, match="--eod-mask-loss with --mock-data: synthetic tokens have no end-of-document"):
        validate(cfg, 1)

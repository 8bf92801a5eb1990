"""A Megatron-LM command line runs as it is (issue 15): two of its example scripts, flag for flag.

The command lines below are Megatron-LM's (core_v0.16.1) examples/gpt3/train_gpt3_175b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh with every flag kept, in their order. Only these change: the sizes
(a tiny model, a few iterations), the paths (a tmp dir) and the data, which is `--mock-data` (the Llama script's
own MOCK branch; the GPT-3 script's --data-path/--vocab-file/--merge-file give way to it). Each trains 3
iterations on CPU in one process, the LR of each step equal to Megatron-LM's formula in samples.

- GPT-3 175B: trains unchanged on Megatron-LM's defaults for what it leaves unset (dropout 0.1 on the residual
  branches and the attention probabilities; fp16's first loss scale 2^32 with hysteresis 2, so its first 14 steps
  overflow and are skipped as they would be in Megatron-LM), --fp16 included (it works on CPU), ramp-up,
  --lr-warmup-fraction and the `--save X --load X` idiom with X not made yet; 20 iterations.
- Llama 3 8B as the script stands (DTYPE fp8: hybrid format, amax history 1024, --fp8-param-gather) trains; with
  the script's DTYPE switch at bf16 it trains too,
  --decoupled-lr/--decoupled-min-lr (the embedding and output layer on their own schedule) and
  --train-samples/--lr-decay-samples/--lr-warmup-samples included.

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
                "--train-iters", "20", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style",
                "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "20"]
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


FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
       "--fp8-param-gather"]  # the Llama script's DTYPE_ARGS at its default DTYPE=fp8


def test_gpt3_175b_example_trains_unchanged_on_megatrons_defaults(tmp_path):
    proc, _ = launch(gpt3_175b(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = json.load(open(tmp_path / "tb" / "metrics.args.json"))
    assert (args["hidden_dropout"], args["attention_dropout"]) == (0.1, 0.1)  # Megatron-LM's, unless told otherwise
    assert "defaults that are not Megatron-LM's" not in proc.stdout  # it gives every flag Megatron-LM requires
    records = train_records(tmp_path / "tb" / "metrics.jsonl")
    consumed = [2, 4] + [4 + 4 * k for k in range(1, 19)]  # ramp-up 2 2 4 to the global batch 4
    assert [r["consumed_samples"] for r in records] == consumed
    # Iteration-based: decay 20 x 4 samples, warm-up .001 of it; the LR position is the samples consumed, skipped
    # steps included (Megatron-LM's scheduler does not advance on a skipped step: docs/from-megatron.md).
    assert [r["lr"] for r in records] == [megatron_lr(s, 6.0e-5, 6.0e-6, 0.001 * 80, 80) for s in [0] + consumed[:-1]]
    # fp16 from 2^32: the first overflow spends the hysteresis, each further one halves the scale, until it fits
    scales = [r["loss_scale"] for r in records]
    assert scales[:3] == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30] and records[0]["skipped"] == 1
    trained = [r for before, r in zip(records, records[1:]) if r["skipped"] == before["skipped"]]
    assert len(trained) >= 5 and all(math.isfinite(r["lm_loss"]) and math.isfinite(r["grad_norm"]) for r in trained)
    assert "saved checkpoint at iteration 20" in proc.stdout and not our_lines(proc)


def test_llama3_8b_example_trains_as_it_stands_in_fp8_and_at_bf16(tmp_path):
    (tmp_path / "fp8").mkdir()
    fp8 = llama3_8b(tmp_path / "fp8")  # a run of its own (its --save resumes otherwise)
    at = fp8.index("--use-distributed-optimizer")  # the script's DTYPE_ARGS follow TRAINING_ARGS
    proc, _ = launch(fp8[:at] + FP8 + fp8[at:], timeout=120)  # its default DTYPE=fp8: every FP8 flag taken
    assert proc.returncode == 0 and not our_lines(proc), proc.stderr[-3000:]
    assert "fp8_param_gather ................................ True" in proc.stdout
    args = llama3_8b(tmp_path)
    proc, _ = launch(args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = train_records(tmp_path / "tb" / "metrics.jsonl")
    assert [r["consumed_samples"] for r in records] == [4, 8, 12]  # --train-samples 12 / global batch 4
    assert [r["lr"] for r in records] == [megatron_lr(s, 0.00015, 0.00001, 2, 11) for s in (0, 4, 8)]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("pretrain_gpt.py: note:")]
    # implementation choices, what Ternion always does, what it leaves out (--overlap-param-gather, which the
    # script gives with the distributed optimizer, is built: no note)
    assert len(notes) == 3, notes
    assert not any("--overlap-param-gather" in note for note in notes)
    assert notes[0].startswith("pretrain_gpt.py: note: Megatron-LM implementation choices") and \
        "--use-mcore-models" in notes[0] and "--attention-backend fused" in notes[0]
    assert "--calculate-per-token-loss" in notes[1] and "--num-workers 1" in notes[2]
    assert "saved checkpoint at iteration 3" in proc.stdout
    cfg = parse_config(args)
    assert (cfg.optim.decoupled_lr, cfg.optim.decoupled_min_lr) == (5.0e-4, 4.5e-5)  # taken, with their meaning


def test_help_gives_megatrons_default_and_a_note_lists_the_unset_flags_whose_default_differs():
    helps = {s: a.help for a in build_parser()._actions for s in a.option_strings}
    assert helps["--hidden-dropout"].endswith("(default: 0.1, as Megatron-LM)")
    assert helps["--initial-loss-scale"].endswith("(default: 4294967296.0, as Megatron-LM)")
    assert helps["--lr-decay-style"].endswith("(default: linear, as Megatron-LM)")
    assert helps["--log-interval"].endswith("(default: 1; Megatron-LM: 100)")
    assert helps["--lr"].endswith("(default: 0.0003; Megatron-LM: none, required)")
    assert helps["--spike-window"].endswith("(default: 50)")  # Ternion's own flag
    from engine.flags import FIELDS, flag_of
    for name, f in FIELDS.items():
        if not f.metadata["yaml_only"]:
            assert "(default: " in helps[flag_of(name)], name
    note = parse_config(["--mock-data", "--num-layers", "2", "--log-interval", "5"]).defaults_note
    assert note.startswith("defaults that are not Megatron-LM's, for flags not given: --hidden-size 64 (Megatron-LM: "
                           "required), ") and note.endswith("--eval-iters 10 (Megatron-LM: 100)")
    assert "--num-layers" not in note and "--log-interval" not in note and "--moe-router-dtype" not in note
    assert "--moe-router-dtype fp32 (Megatron-LM: unset, the model's dtype)" in \
        parse_config(["--mock-data", "--num-experts", "4"]).defaults_note  # MoE flags for an MoE model
    given = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "1", "--train-samples", "64", "--lr", "1e-3", "--log-interval", "100",
             "--eval-iters", "100"]
    assert parse_config(["--mock-data", *given]).defaults_note is None


def test_every_problem_of_a_command_line_is_a_line_of_one_message():
    """Unknown, refused, wrongly valued, contradictory and invalid flags: all found before any process group, a
    line each in the command line's order of kinds (parsing, Megatron-LM's table, settings), the hint once."""
    from engine.config.fields import Problems
    argv = ["--mock-data", "--data-path", "corpus", "--frobnicate", "3", "--squared-relu", "--lr-decay-style",
            "bogus", "--rotary-percent", "0.5", "--num-attention-heads", "4", "--tp", "3", "--min-lr", "1", "--lr",
            "0.1", "--decoupled-min-lr", "1e-5"]
    problems = Problems()
    validate(parse_config(argv, problems), 6, problems)
    with pytest.raises(ConfigError) as info:
        problems.raise_all()
    assert str(info.value).splitlines() == [
        "argument --lr-decay-style: invalid choice: 'bogus' (choose from 'constant', 'linear', 'cosine', "
        "'inverse-square-root', 'wsd', 'WSD')",
        "unknown flag --frobnicate",
        "--squared-relu: the squared-ReLU MLP is not implemented; use the GELU MLP (default) or --swiglu "
        "(python launch/pretrain_gpt.py --help)",
        "--rotary-percent 0.5: rotary embeddings on part of each head are not implemented here; use 1.0 (RoPE on "
        "the whole head)",
        "--mock-data with --data-path: choose one (--mock-data trains on synthetic tokens, --data-path on your data)",
        "--tensor-model-parallel-size 3: must divide --num-attention-heads 4; choose a tp among 1, 2, 4",
        "--min-lr 1.0: must not exceed --lr 0.1",
        "--decoupled-min-lr 1e-05: applies with --decoupled-lr only; give --decoupled-lr (the embedding and output "
        "layer's peak LR) or drop it",
        "--data-path corpus: corpus.bin not found; give the prefix without .bin/.idx, made by tools/preprocess_data.py"]


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


def test_docs_from_megatron_name_every_refused_flag_and_every_default_kept():
    import os
    import re

    from engine.flags import kept_defaults
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "from-megatron.md")).read()
    named = set(re.findall(r"`(--[a-z0-9-]+)", text))
    refused = {f.name for f in megatron_flags.FLAGS if f.kind == megatron_flags.REFUSED}
    kept = {flag for flag, _, _ in kept_defaults({"num_experts": 4})}
    assert not (refused | kept) - named, sorted((refused | kept) - named)


def test_a_tool_lists_every_unknown_flag_and_wrong_value_each_on_its_own_line(capsys):
    from engine.cli import OneLineParser
    p = OneLineParser(prog="t.py")
    p.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as info:
        p.parse_args(["--frobnicate", "3", "--steps", "x", "--bogus"])
    assert info.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "t.py: error: argument --steps: invalid int value: 'x'", "t.py: error: unknown flag --frobnicate",
        "t.py: error: unknown flag --bogus (python t.py --help lists them)"]

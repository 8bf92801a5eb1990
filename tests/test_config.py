"""Config: YAML + flags, aliases, --help, and one clear line per mistake (before any process group)."""
import pytest

from engine import cli, config, validation
from engine.cli import build_parser, parse_config
from engine.config import ConfigError
from engine.data.build import data_prefixes
from engine.flags import FIELD_SECTION, all_fields, field_type, flag_of
from engine.validation import validate


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_then_flags_override_with_megatron_names_and_aliases(tmp_path):
    path = write(tmp_path, "num-layers: 6\nhidden_size: 96\ntensor_model_parallel_size: 2\nmock_data: true\n")
    cfg = parse_config(["--config", path, "--tp", "1", "--pp", "2", "--vpp", "3", "--lr", "0.5"])
    assert cfg.model.num_layers == 6 and cfg.model.hidden_size == 96
    assert (cfg.tp, cfg.pp, cfg.parallel.virtual_pipeline_model_parallel_size) == (1, 2, 3)
    assert cfg.optim.lr == 0.5 and cfg.data.mock_data


def test_help_documents_every_flag(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--tensor-model-parallel-size", "--tp", "--pipeline-model-parallel-size", "--vpp",
                 "--sequence-parallel", "--use-distributed-optimizer", "--rampup-batch-size", "--data-path",
                 "--inject-fault", "--spike-rollback-after", "--attention-backend", "--exit-duration-in-mins"):
        assert flag in text
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"


def check(argv, world, *needles):
    with pytest.raises(ConfigError) as info:
        validate(parse_config(argv + ([] if "--data-path" in argv else ["--mock-data"])), world)
    msg = str(info.value).splitlines()[0]  # the mistake made; a line each for any other the flags hold
    for needle in needles:
        assert needle in msg, str(info.value)
    return msg


def test_each_mistake_is_one_line_naming_flag_value_and_fix(tmp_path):
    check(["--num-attention-heads", "4", "--tp", "3"], 6, "--tensor-model-parallel-size 3", "choose a tp among 1, 2, 4")
    check(["--pp", "4", "--num-layers", "8"], 6, "--pipeline-model-parallel-size 4", "world size 6")
    check(["--num-layers", "6", "--pp", "4"], 8, "--pipeline-model-parallel-size 4", "--num-layers 6",
          "choose a pp among 1, 2, 3, 6")
    check(["--num-layers", "8", "--pp", "2", "--vpp", "3"], 8, "--virtual-pipeline-model-parallel-size 3",
          "--num-layers 8", "choose a vpp among 1, 2, 4")
    check(["--global-batch-size", "10", "--micro-batch-size", "4"], 2, "--global-batch-size 10", "multiple")
    check(["--num-attention-heads", "8", "--num-query-groups", "2", "--tp", "4"], 4, "--num-query-groups 2")
    check(["--tp", "4", "--gpus-per-node", "2", "--num-attention-heads", "4"], 4, "span nodes")
    check(["--bf16", "--fp16"], 1, "--bf16")
    check(["--num-layers", "8", "--pp", "2", "--vpp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"], 2,
          "--global-batch-size 6", "multiple of pp 2")
    check(["--inject-fault", "boom@3"], 1, "--inject-fault boom@3")
    check(["--data-path", str(tmp_path / "nothing")], 1, "--data-path", "nothing.bin not found")
    check(["--tokenizer-model", str(tmp_path / "x.model")], 1, "--tokenizer-model")
    check(["--num-layers", "11", "--pp", "4", "--decoder-first-pipeline-num-layers", "3",
           "--decoder-last-pipeline-num-layers", "3"], 4, "cannot be split evenly")
    validate(parse_config(["--num-layers", "10", "--pp", "4", "--decoder-first-pipeline-num-layers", "1",
                           "--decoder-last-pipeline-num-layers", "3", "--mock-data"]), 4)


def test_unknown_yaml_key_names_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'num_layer'.*did you mean 'num-layers'"):
        parse_config(["--config", write(tmp_path, "num_layer: 4\n")])
    with pytest.raises(ConfigError, match="--normalization"):
        parse_config(["--config", write(tmp_path, "normalization: BatchNorm\n")])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_every_shipped_config_validates():
    import glob
    for path in sorted(glob.glob("configs/*.yaml")):
        cfg = parse_config(["--config", path, "--mock-data"])
        world = cfg.tp * cfg.pp * cfg.cp * cfg.parallel.expert_model_parallel_size  # ep is carved from dp
        validate(cfg, world)


def test_run_flags_the_launcher_used_to_check_are_validated_here(tmp_path):
    check(["--profile"], 1, "--profile", "--tensorboard-dir")
    check(["--profile", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "5", "--profile-step-end", "3"], 1,
          "--profile-step-start 5", "--profile-step-end 3")
    check(["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes 0", "positive")
    validate(parse_config(["--profile", "--tensorboard-dir", str(tmp_path), "--mock-data"]), 1)


# Each section's check on its own: the defaults pass, one bad value fails with a line naming its flag.
SECTION_CASES = {
    "parallel-sizes": (lambda **kw: validation._check_parallel_sizes(config.ParallelConfig(**kw)),
                       {"virtual_pipeline_model_parallel_size": 0}, "--virtual-pipeline-model-parallel-size 0"),
    "model": (lambda **kw: validation.check_model(config.ModelConfig(**kw)), {"hidden_size": 66}, "--hidden-size 66"),
    "split": (lambda **kw: validation._check_split(config.ModelConfig(seq_length=63), config.ParallelConfig(**kw),
                                               tp=2, pp=1, vpp=1),
              {"sequence_parallel": True}, "--seq-length 63"),
    "pipeline-split": (lambda layers=10: validation._check_pipeline_split(layers, 1, 3, 4, 1), {"layers": 11},
                       "--decoder-first-pipeline-num-layers 1"),
    "parallel": (lambda **kw: validation._check_parallel(config.ParallelConfig(**kw), 4),
                 {"distributed_timeout_minutes": -1}, "--distributed-timeout-minutes -1"),
    "training": (lambda **kw: validation._check_training(config.TrainingConfig(**kw), 2, 1, 1),
                 {"global_batch_size": 3}, "--global-batch-size 3"),
    "optim": (lambda **kw: validation._check_optim(config.OptimizerConfig(**kw)), {"lr_decay_style": "wsd"},
              "--lr-wsd-decay-iters"),
    "logging": (lambda **kw: validation._check_logging(config.LoggingConfig(**kw)), {"profile": True}, "--profile"),
    "files": (lambda **kw: validation._check_files(config.Config(data=config.DataConfig(mock_data=True, **kw))),
              {"tokenizer_model": "/nonexistent/t.model"}, "--tokenizer-model /nonexistent/t.model"),
    "stability": (lambda spike_window=50: validation.check_spike_window(spike_window), {"spike_window": 1},
                  "--spike-window 1"),
}


@pytest.mark.parametrize("section", SECTION_CASES)
def test_each_section_check_rejects_a_bad_value_naming_its_flag(section):
    run, bad, needle = SECTION_CASES[section]
    run()
    with pytest.raises(ConfigError) as info:
        run(**bad)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_spike_window_has_one_check_for_validate_and_the_guard():
    from engine.stability import SpikeGuard
    validation.check_spike_window(2)
    with pytest.raises(ConfigError) as direct:
        validation.check_spike_window(1)
    with pytest.raises(ConfigError) as guard:
        SpikeGuard(window=1)
    assert str(direct.value) == str(guard.value) == check(["--spike-window", "1"], 1, "--spike-window 1")


def test_topology_raises_the_line_validate_raises():
    from engine.parallel.topology import build_context, rank_grid
    msg = check(["--pp", "4", "--num-layers", "8"], 6, "does not divide the world size 6")
    with pytest.raises(ConfigError) as info:
        rank_grid(6, 1, 4)
    assert str(info.value) == msg
    msg = check(["--tp", "4", "--gpus-per-node", "2", "--num-attention-heads", "4"], 4, "span nodes")
    with pytest.raises(ConfigError) as info:
        build_context(4, 0, 4, 1, gpus_per_node=2)  # raises before it makes any process group
    assert str(info.value) == msg


def test_schedule_and_validate_share_the_interleaving_rule():
    from engine.layout import PipelineSchedule
    from engine.pipeline.schedules import check_schedule
    msg = check(["--num-layers", "8", "--pp", "2", "--vpp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
                2, "--global-batch-size 6: gives 3 microbatches")
    with pytest.raises(ConfigError) as info:
        check_schedule(PipelineSchedule.of(None, 2, 2), 3)
    # The schedule knows the count, not the batch flag that led to it: same rule, its own flag and value.
    assert str(info.value).startswith("--virtual-pipeline-model-parallel-size 2: ")
    assert str(info.value).split(": ", 1)[1] == msg.split(": ", 1)[1]
    check_schedule(PipelineSchedule.of(None, 2, 2), 4)


def test_model_split_check_names_the_flags_it_is_given():
    model = config.ModelConfig(num_layers=6, num_attention_heads=4, num_query_groups=2, hidden_size=64)
    validation.check_model_split(model, 2, 3)
    cases = [((4, 1), "--target-tp 4: must divide --num-query-groups 2; choose a tp among 1, 2"),
             ((3, 1), "--target-tp 3: must divide --num-attention-heads 4"),
             ((1, 4), "--target-pp 4: must divide --num-layers 6; choose a pp among 1, 2, 3, 6")]
    for (tp, pp), expected in cases:
        with pytest.raises(ConfigError) as info:
            validation.check_model_split(model, tp, pp, tp_flag="--target-tp", pp_flag="--target-pp")
        assert str(info.value).startswith(expected), str(info.value)
    with pytest.raises(ConfigError, match="^--tensor-model-parallel-size 3: must divide --ffn-hidden-size 256"):
        validation.check_model_split(config.ModelConfig(num_attention_heads=3, hidden_size=48, ffn_hidden_size=256), 3, 1)


def test_yaml_only_fields_have_no_flag_and_pass_through_from_yaml(tmp_path):
    yaml_only = [f.name for _, f in all_fields() if f.metadata["yaml_only"]]
    assert yaml_only == ["data_phases"]
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert "--data-phases" not in flags
    assert {flag_of(f.name) for _, f in all_fields() if not f.metadata["yaml_only"]} <= flags
    with pytest.raises(ConfigError, match="^--data-phases: data_phases has no command-line form; set it in the "
                                          "--config YAML file"):
        parse_config(["--data-phases", "x"])
    phases = [{"start_iter": 5, "weights": [0.3, 0.7]}, {"start_iter": 9, "weights": [1, 0]}]
    assert cli._coerce("data_phases", phases) is phases
    path = write(tmp_path, "data_phases:\n  - {start_iter: 5, weights: [0.3, 0.7]}\n"
                           "  - {start_iter: 9, weights: [1, 0]}\n")
    assert parse_config(["--config", path]).data.data_phases == phases


def test_field_types_come_from_the_annotations(tmp_path):
    path = write(tmp_path, "ffn_hidden_size: '128'\ndistributed_timeout_minutes: 5\nrampup_batch_size: 4 4 40\n"
                           "tokenizer_model: 12\n")
    cfg = parse_config(["--config", path, "--peak-tflops", "2", "--gpus-per-node", "8"])
    assert cfg.model.ffn_hidden_size == 128 and type(cfg.model.ffn_hidden_size) is int
    assert type(cfg.parallel.distributed_timeout_minutes) is float
    assert cfg.training.rampup_batch_size == [4, 4, 40] and cfg.data.tokenizer_model == "12"
    assert type(cfg.logging.peak_tflops) is float and cfg.parallel.gpus_per_node == 8
    with pytest.raises(ConfigError, match="^--num-query-groups: value 2.5 is not a valid int;"):
        parse_config(["--config", write(tmp_path, "num_query_groups: 2.5\n", "bad.yaml")])


def test_unknown_flags_and_bad_values_are_one_line_naming_the_nearest_flag():
    with pytest.raises(ConfigError) as info:
        parse_config(["--mock-data", "--sequence-paralel"])
    assert str(info.value) == ("unknown flag --sequence-paralel; did you mean --sequence-parallel? "
                               "(python launch/pretrain_gpt.py --help lists them)")
    with pytest.raises(ConfigError, match=r"^unknown flag --frobnicate \(python launch/pretrain_gpt.py --help"):
        parse_config(["--frobnicate=3"])
    with pytest.raises(ConfigError, match=r"^argument --tensor-model-parallel-size/--tp: invalid int value: 'x' "):
        parse_config(["--tp", "x"])
    with pytest.raises(ConfigError, match="^unexpected argument '2'"):
        parse_config(["--lr", "1", "2"])
    # a prefix of a flag is not taken for it (argparse would set --seq-length from --seq-len without a word)
    with pytest.raises(ConfigError, match=r"^unknown flag --seq-len; did you mean --seq-length\?"):
        parse_config(["--mock-data", "--seq-len", "32"])


def test_every_boolean_switches_off_from_the_command_line(tmp_path):
    bools = [f.name for _, f in all_fields() if field_type(f) is bool]
    assert "mock_data" in bools and "sequence_parallel" in bools
    path = write(tmp_path, "".join(f"{name}: true\n" for name in bools))
    assert all(getattr(getattr(parse_config(["--config", path]), FIELD_SECTION[n]), n) for n in bools)
    off = [("--load-optim" if n == "no_load_optim" else "--no-" + n.replace("_", "-")) for n in bools]
    cfg = parse_config(["--config", path, *off])
    assert not any(getattr(getattr(cfg, FIELD_SECTION[n]), n) for n in bools)
    assert parse_config(["--no-load-optim"]).checkpoint.no_load_optim  # the Megatron-LM name still works


def test_data_path_overrides_a_config_files_mock_data_with_a_notice(tmp_path):
    path = write(tmp_path, "mock_data: true\nnum_layers: 2\n")
    cfg = parse_config(["--config", path, "--data-path", "corpus_text_document"])
    assert not cfg.data.mock_data and cfg.data.data_path == ["corpus_text_document"]
    assert cfg.notices == [f"--data-path given: training on corpus_text_document, not on the synthetic tokens that "
                           f"mock_data: true in {path} asks for (pass --mock-data for those)"]
    cfg = parse_config(["--config", path])
    assert cfg.data.mock_data and cfg.notices == []  # mock only when asked (here: by the file, with no data)
    both = write(tmp_path, "mock_data: true\ndata_path: [a]\n", "both.yaml")
    cfg = parse_config(["--config", both, "--mock-data"])  # the command line beats the file
    assert cfg.data.mock_data and cfg.data.data_path is None and "is not used" in cfg.notices[0]
    assert not parse_config(["--config", both]).data.mock_data  # data given in the file wins over its mock flag
    with pytest.raises(ConfigError, match="^--mock-data with --data-path: choose one"):
        parse_config(["--mock-data", "--data-path", "a"])


@pytest.mark.parametrize("data_path,needle", [
    (["nan", "a", "1", "b"], "--data-path nan: each blend weight must be a finite non-negative number"),
    (["inf", "a", "1", "b"], "--data-path inf: each blend weight must be a finite"),
    (["-1", "a", "1", "b"], "--data-path -1: each blend weight"),
    (["0", "a", "0", "b"], "--data-path 0 a 0 b: the blend weights sum to 0"),
])
def test_bad_blend_weights_are_one_line_naming_the_weight(data_path, needle):
    with pytest.raises(ConfigError) as info:
        data_prefixes(data_path)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_every_shipped_mock_config_trains_on_data_when_given(tmp_path):
    import glob
    shipped = [p for p in sorted(glob.glob("configs/*.yaml")) if parse_config(["--config", p]).data.mock_data]
    # gpt2-125m, gpt3-175b, llama2-70b, llama3-1b, llama3-8b, llama3-8b-128k, llama3-70b, llama3-405b,
    # mixtral-8x7b, deepseek-v3
    assert len(shipped) == 10, shipped
    for path in shipped:
        cfg = parse_config(["--config", path, "--data-path", "corpus_text_document", "--tokenizer-model", "t.model"])
        assert not cfg.data.mock_data and len(cfg.notices) == 1 and path in cfg.notices[0]
        assert cfg.data.tokenizer_model == "t.model"  # resolve() then takes the vocabulary from the tokenizer

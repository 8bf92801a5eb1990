"""Config: YAML + flags, aliases, --help, and one clear line per mistake (before any process group)."""
import pytest

from engine.config import ConfigError, build_parser, parse_config, validate


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_then_flags_override_with_megatron_names_and_aliases(tmp_path):
    path = write(tmp_path, "num-layers: 6\nhidden_size: 96\ntensor_model_parallel_size: 2\nmock_data: true\n")
    cfg = parse_config(["--config", path, "--tp", "1", "--pp", "2", "--vpp", "3", "--lr", "0.5"])
    assert cfg.model.num_layers == 6 and cfg.model.hidden_size == 96
    assert (cfg.tp, cfg.pp, cfg.vpp) == (1, 2, 3)
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
        validate(parse_config(argv + ["--mock-data"]), world)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_each_mistake_is_one_line_naming_flag_value_and_fix(tmp_path):
    check(["--num-attention-heads", "4", "--tp", "3"], 6, "--tensor-model-parallel-size 3", "choose a tp among 1, 2, 4")
    check(["--pp", "4", "--num-layers", "8"], 6, "--pipeline-model-parallel-size 4", "world size 6")
    check(["--num-layers", "6", "--pp", "4"], 8, "--num-layers 6", "pp x vpp")
    check(["--num-layers", "8", "--pp", "2", "--vpp", "3"], 8, "--num-layers 8")
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
        world = cfg.tp * cfg.pp
        validate(cfg, world)

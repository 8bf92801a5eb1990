"""Metrics file and TensorBoard tags as the contract names them; the console line's fields (its averaging
over --log-interval: tests/test_log_line.py); resume appends."""
import json
import math

import pytest
import torch

from engine.config import Config
from engine.metrics import TB_TAGS, TRAIN_KEYS, MetricsWriter, format_log_line, metrics_path, peak_tflops, throughput

CONTRACT_TAGS = {"lm-loss", "lr", "grad-norm", "loss-scale", "tokens-per-sec", "tflops-per-gpu", "mfu",
                 "mem-peak-gb", "valid/lm-loss", "valid/ppl"}


def make_cfg(tmp_path, tb=True):
    cfg = Config()
    cfg.model.vocab_size = 256
    if tb:
        cfg.logging.tensorboard_dir = str(tmp_path / "tb")
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    return cfg


def train_record(cfg, it, loss):
    rec = {"iteration": it, "consumed_samples": 8 * it, "lm_loss": torch.tensor(loss), "lr": 1e-3,
           "grad_norm": 0.5, "loss_scale": 1.0, "skipped": 0, "mem_peak_gb": 1.5, "train_iters": 10}
    rec.update(throughput(cfg.model, global_batch_size=8, seconds=0.5, num_gpus=2, tp_size=cfg.tp, peak=100.0))
    return rec


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def tb_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_path_defaults(tmp_path):
    cfg = make_cfg(tmp_path)
    assert metrics_path(cfg) == str(tmp_path / "tb" / "metrics.jsonl")
    cfg.logging.metrics_file = str(tmp_path / "m.jsonl")
    assert metrics_path(cfg) == str(tmp_path / "m.jsonl")
    cfg = make_cfg(tmp_path, tb=False)
    assert metrics_path(cfg) == str(tmp_path / "ckpt" / "metrics.jsonl")
    cfg.checkpoint.save = None
    assert metrics_path(cfg) is None
    assert peak_tflops(cfg, torch.device("cpu")) is None
    cfg.logging.peak_tflops = 312.0
    assert peak_tflops(cfg, torch.device("cpu")) == 312.0


def test_records_and_tensorboard_tags(tmp_path):
    cfg = make_cfg(tmp_path)
    w = MetricsWriter(cfg, rank=0)
    for it in (1, 2, 3):
        w.log_train(train_record(cfg, it, 5.0 - it))
    w.log_valid(3, torch.tensor(2.5))
    w.log_event(3, "spike", loss=9.0, threshold=4.0)
    w.log_train({**train_record(cfg, 4, 1.0), "lm_loss": float("nan"), "mfu": None})
    with pytest.raises(ValueError, match="grad_norm"):
        w.log_train({k: v for k, v in train_record(cfg, 5, 1.0).items() if k != "grad_norm"})
    w.close()

    records = read_jsonl(metrics_path(cfg))
    train = [r for r in records if "split" not in r and "event" not in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert set(TRAIN_KEYS) <= set(r)
    assert train[0]["lm_loss"] == 4.0 and train[0]["tokens_per_sec"] == 8 * cfg.model.seq_length / 0.5
    assert train[0]["mfu"] == pytest.approx(train[0]["tflops_per_gpu"] / 100.0)
    assert train[3]["lm_loss"] is None and train[3]["mfu"] is None
    valid = [r for r in records if r.get("split") == "valid"]
    assert valid == [{"iteration": 3, "split": "valid", "lm_loss": 2.5, "ppl": pytest.approx(math.exp(2.5))}]
    events = [r for r in records if "event" in r]
    assert events[0]["event"] == "spike" and events[0]["loss"] == 9.0

    scalars = tb_scalars(tmp_path / "tb")
    assert set(scalars) == CONTRACT_TAGS
    assert [s for s, _ in scalars["lm-loss"]] == [1, 2, 3]  # the NaN loss is not plotted
    assert scalars["valid/ppl"][0][1] == pytest.approx(math.exp(2.5))
    moe = {"moe/aux-loss", "moe/z-loss", "moe/max-load", "moe/dropped-tokens"}  # written by MoE runs only
    mtp = {"mtp-loss"}  # by runs with --mtp-num-layers only
    assert set(TB_TAGS.values()) | {"valid/lm-loss", "valid/ppl"} == CONTRACT_TAGS | moe | mtp


def test_other_ranks_write_nothing_and_resume_appends(tmp_path):
    cfg = make_cfg(tmp_path, tb=False)
    quiet = MetricsWriter(cfg, rank=1)
    quiet.log_train(train_record(cfg, 1, 3.0))
    quiet.close()
    assert not (tmp_path / "ckpt").exists()
    first = MetricsWriter(cfg, rank=0)
    for it in (1, 2, 3):
        first.log_train(train_record(cfg, it, 3.0))
    first.close()
    resumed = MetricsWriter(cfg, rank=0, start_iteration=2)
    resumed.log_train(train_record(cfg, 3, 2.0))
    resumed.close()
    assert [(r["iteration"], r["lm_loss"]) for r in read_jsonl(metrics_path(cfg))] == \
        [(1, 3.0), (2, 3.0), (3, 3.0), (3, 2.0)]


def test_format_log_line(tmp_path):
    cfg = make_cfg(tmp_path)
    rec = {**train_record(cfg, 4, 2.345678), "consumed_tokens": 2_500_000, "skipped_iterations": 1}
    line = format_log_line(rec)
    for piece in ("iteration        4/      10", "consumed samples:           32", "consumed tokens: 2.5M",
                  "lm loss: 2.345678E+00", "learning rate: 1.000000E-03", "grad norm: 0.500", "loss scale: 1.0",
                  "number of skipped iterations:   1", "tokens per second: ", " per GPU)", "(TFLOP/s/GPU): ",
                  "MFU: ", "peak memory (GiB): 1.50", "elapsed time per iteration (ms): 500.0", "ETA: 0:00:03"):
        assert piece in line, (piece, line)
    assert line.startswith("iteration ")  # no timestamp without a "time"
    assert format_log_line({**rec, "time": 0.0}).startswith("[19")  # with one: [YYYY-MM-DD HH:MM:SS] first
    assert "ETA: 1:01:40" in format_log_line({**rec, "eta_s": 3700.0})
    bare = format_log_line({"iteration": 7, "lm_loss": float("nan"), "mfu": None})
    assert bare == "iteration        7 | lm loss: nan"


def test_wandb_logs_the_same_scalars_when_asked(tmp_path, monkeypatch):
    """Megatron-LM's --wandb-project: the TensorBoard scalars under the same tags, one run, finished on close
    (a stand-in module records the calls; the wandb package is optional and not installed here)."""
    import sys
    import types
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append((step, values)),
                                finish=lambda: calls.append("finished"))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: calls.append(kw) or run))
    cfg = make_cfg(tmp_path, tb=False)
    cfg.logging.wandb_project, cfg.logging.wandb_exp_name = "ternion-test", "tiny"
    writer = MetricsWriter(cfg, rank=0)
    writer.log_train(train_record(cfg, 3, 2.5))
    writer.log_valid(3, 2.0)
    writer.close()
    assert calls[0]["project"] == "ternion-test" and calls[0]["name"] == "tiny" and calls[-1] == "finished"
    logged = {tag: (step, value) for step, values in calls[1:-1] for tag, value in values.items()}
    assert logged["lm-loss"] == (3, 2.5) and logged["valid/lm-loss"] == (3, 2.0)
    assert {"lm-loss", "lr", "grad-norm", "tokens-per-sec", "mfu", "valid/ppl"} <= set(logged)
    assert MetricsWriter(cfg, rank=1).wandb is None  # rank 0 alone logs


def test_wandb_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    from engine.config import ConfigError
    from engine.validation import validate
    cfg = make_cfg(tmp_path, tb=False)
    cfg.data.mock_data, cfg.logging.wandb_project = True, "p"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match="^--wandb-project p: the wandb package is not installed here"):
        validate(cfg, 1)

"""The console a run is watched by: the log line averaged over --log-interval (engine.metrics.LogInterval),
the checkpoint save lines (engine.metrics.save_report), the resolved arguments printed and kept beside the
metrics file (engine.report.report_arguments), and one small run that shows them end to end.

Unit tests of the classes with made-up records and a fixed clock; the launcher run is one process of a
one-layer model for 4 iterations (about 20 s on two busy cores, most of it importing torch).
"""
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from engine.cli import parse_config
from engine.config import Config
from engine.metrics import LogInterval, MetricsWriter, arguments_path, format_log_line, save_report
from engine.report import ARGUMENTS_END, ARGUMENTS_RULE, report_arguments, resolved_arguments
from engine.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +\d+/ +\d+ \| ")
NOON = time.mktime((2026, 11, 23, 15, 40, 1, 0, 0, -1))  # local time, as the line shows it
SEQ = 64


def record(it, loss, seconds, batch=16, grad_norm=0.5, gpus=2, total=100):
    """A training record as engine.training._record makes it, speed fields from the iteration's time."""
    tokens = batch * SEQ
    return {"iteration": it, "train_iters": total, "consumed_samples": batch * it, "consumed_tokens": tokens * it,
            "lm_loss": loss, "lr": 1e-3 * it, "grad_norm": grad_norm, "loss_scale": 1.0, "skipped": 0,
            "tokens_per_sec": tokens / seconds, "tokens_per_sec_per_gpu": tokens / seconds / gpus,
            "tflops_per_gpu": 2.0 * tokens / seconds / 1e3, "mfu": 2.0 * tokens / seconds / 1e3 / 100.0,
            "iter_time_s": seconds, "mem_peak_gb": None}


def field(line, label):
    """The value after `label: ` in a log line."""
    return re.search(re.escape(label) + r": ([^|]+?)(?: \||$)", line).group(1)


def feed(interval, records):
    return [line for line in map(interval.add, records) if line is not None]


def test_the_line_comes_every_log_interval_and_at_the_last_iteration():
    lines = feed(LogInterval(4, clock=lambda: NOON), [record(i, 3.0, 0.5, total=10) for i in range(1, 11)])
    assert [int(re.search(r"iteration +(\d+)/", x).group(1)) for x in lines] == [4, 8, 10]
    assert all(STAMP.match(x) for x in lines), lines
    assert lines[0].startswith("[2026-11-23 15:40:01] iteration        4/      10 | consumed samples:           64 |")


def test_loss_is_the_mean_of_the_interval_and_skipped_iterations_are_left_out_but_counted():
    losses = [4.0, 3.5, float("nan"), 3.0, 2.5]
    recs = [record(i + 1, loss, 0.5) for i, loss in enumerate(losses)]
    recs[1]["grad_norm"] = float("inf")  # a finite loss with an overflowed gradient: skipped as well
    pending = LogInterval(100, clock=lambda: NOON)  # no line due yet: its summary is the interval so far
    assert feed(pending, recs) == []
    summary = pending.summary()
    assert summary["lm_loss"] == pytest.approx((4.0 + 3.0 + 2.5) / 3)
    assert summary["skipped_iterations"] == 2 and summary["interval_iterations"] == 5
    line = feed(LogInterval(5, clock=lambda: NOON), recs)[0]
    assert line == format_log_line(summary)
    assert float(field(line, "lm loss")) == pytest.approx((4.0 + 3.0 + 2.5) / 3, rel=1e-6)
    assert int(field(line, "number of skipped iterations")) == 2
    # lr, grad norm, loss scale and consumed samples are the last iteration's
    assert float(field(line, "learning rate")) == pytest.approx(5e-3) and field(line, "grad norm") == "0.500"
    assert int(field(line, "consumed samples")) == 80 and field(line, "loss scale") == "1.0"
    every = LogInterval(2)  # a whole interval skipped: the loss says nan, the count says 2
    line = feed(every, [record(1, float("nan"), 0.5), record(2, float("nan"), 0.5)])[0]
    assert field(line, "lm loss") == "nan" and int(field(line, "number of skipped iterations")) == 2


def test_speed_is_the_interval_total_over_its_total_time():
    times, batches = [0.2, 0.4, 1.0], [16, 16, 32]  # a slow iteration with a bigger (ramped-up) batch
    recs = [record(i + 1, 3.0, t, batch=b) for i, (t, b) in enumerate(zip(times, batches))]
    line = feed(LogInterval(3), recs)[0]
    expected = sum(b * SEQ for b in batches) / sum(times)  # 2560 tokens/s
    assert abs(sum(r["tokens_per_sec"] for r in recs) / 3 - expected) > 500  # the mean of the rates is not it
    assert float(field(line, "elapsed time per iteration (ms)")) == pytest.approx(1000 * sum(times) / 3, abs=0.05)
    shown = field(line, "tokens per second")
    assert shown == "2,560 (1,280 per GPU)" and expected == pytest.approx(2560), shown
    assert float(field(line, "throughput per GPU (TFLOP/s/GPU)")) == pytest.approx(2.0 * expected / 1e3, rel=1e-2)
    assert field(line, "MFU") == f"{2.0 * expected / 1e3:.3g}%"


def test_eta_comes_from_the_mean_speed_since_start_without_the_first_iteration():
    # iteration 1 is warm-up (5 s); then 0.5 s, 1.5 s alternating: each interval of 2 averages 1 s
    times = [5.0] + [0.5, 1.5] * 10
    interval = LogInterval(2)
    etas = []
    for i, t in enumerate(times, start=1):
        line = interval.add(record(i, 3.0, t, total=100))
        if line:
            etas.append((i, line))
    for it, line in etas:
        steady = [t for t in times[1:it]]
        expected = (100 - it) * sum(steady) / len(steady)
        h, m, s = map(int, field(line, "ETA").split(":"))
        assert h * 3600 + m * 60 + s == round(expected), (it, line)
    # never the single last iteration's speed: 0.5 s and 1.5 s would make the ETA jump by 3x between lines
    assert interval.seconds_per_iteration() == pytest.approx(sum(times[1:]) / len(times[1:]))
    alone = LogInterval(1)  # the very first line has nothing but the warm-up iteration to go by
    assert field(alone.add(record(1, 3.0, 2.0, total=11)), "ETA") == "0:00:20"
    long = format_log_line({"iteration": 1, "train_iters": 10, "lm_loss": 1.0, "eta_s": 2 * 86400 + 3723})
    assert field(long, "ETA") == "2 days, 1:02:03"


def test_the_metrics_file_keeps_per_iteration_values(tmp_path):
    cfg = Config()
    cfg.logging.metrics_file, cfg.logging.log_interval = str(tmp_path / "m.jsonl"), 2
    writer = MetricsWriter(cfg, rank=0)
    recs = [record(1, 4.0, 0.5), record(2, 2.0, 1.5)]
    assert writer.log_train(recs[0]) is None
    line = writer.log_train(recs[1])
    writer.close()
    assert float(field(line, "lm loss")) == pytest.approx(3.0)
    with open(tmp_path / "m.jsonl") as fh:
        written = [json.loads(x) for x in fh]
    assert written == [json.loads(json.dumps(r)) for r in recs]  # not averaged, no key added or dropped


class FakePending:
    def __init__(self, seconds):
        self.iteration, self.error = 7, None
        self.thread = threading.Thread(target=time.sleep, args=(seconds,))
        self.thread.start()


def fake_checkpointer(async_save, rank=0):
    ck = SimpleNamespace(save="/runs/x", async_save=async_save)
    return SimpleNamespace(cfg=SimpleNamespace(checkpoint=ck), ctx=SimpleNamespace(rank=rank), pending=None)


def test_checkpoint_saves_say_when_they_start_and_how_long_they_took():
    lines = []
    sync = fake_checkpointer(False)
    with save_report(sync, 7, lines.append):
        time.sleep(0.05)
    assert lines[0] == "saving checkpoint at iteration 7 into /runs/x ..."
    took = re.fullmatch(r"saved checkpoint at iteration 7 in (\d+\.\d\d) s", lines[1])
    assert took and float(took.group(1)) >= 0.05, lines
    lines.clear()
    background = fake_checkpointer(True)
    with save_report(background, 7, lines.append):
        background.pending = FakePending(0.3)
    assert lines[0] == "saving checkpoint at iteration 7 into /runs/x (async) ..."
    assert re.fullmatch(r"checkpoint save at iteration 7 scheduled \(async\) in \d+\.\d\d s", lines[1]), lines
    assert len(lines) == 2  # the write is still going on
    background.pending.thread.join()
    deadline = time.time() + 5
    while len(lines) < 3 and time.time() < deadline:
        time.sleep(0.01)
    done = re.fullmatch(r"saved checkpoint at iteration 7 in (\d+\.\d\d) s \(async\)", lines[2])
    assert done and float(done.group(1)) >= 0.3, lines
    with pytest.raises(RuntimeError):  # a failed save says nothing more: the error speaks
        with save_report(sync, 8, lines.append):
            raise RuntimeError("disk full")
    assert lines[-1] == "saving checkpoint at iteration 8 into /runs/x ..."


def test_arguments_are_printed_sorted_and_saved_beside_the_metrics_as_a_config(tmp_path):
    cfg = parse_config(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "1",
                        "--tensorboard-dir", str(tmp_path / "tb"), "--global-batch-size", "8"])
    resolve(cfg, 1)
    out = []
    path = report_arguments(cfg, 0, out.append)
    assert path == str(tmp_path / "tb" / "metrics.args.json") == arguments_path(cfg)
    text = out[0].splitlines()
    assert text[0] == ARGUMENTS_RULE and ARGUMENTS_END in text
    rows = text[1:text.index(ARGUMENTS_END)]
    flat = {name: value for section in cfg.to_dict().values() for name, value in section.items()}
    names = [row.split()[0] for row in rows]
    assert names == sorted(flat) and len(names) == len(flat)  # every resolved field, once, sorted
    for row in rows:
        name, dots, value = row.strip().split(" ", 2)
        assert set(dots) == {"."} and value == str(flat[name]), row
    assert "  num_layers ...................................... 1" in rows
    with open(path) as fh:
        saved = json.load(fh)
    assert saved == resolved_arguments(cfg) and saved["vocab_size"] == 256 and saved["global_batch_size"] == 8
    again = parse_config(["--config", path])  # the saved file is a --config file that gives the same run
    assert resolve(again, 1).to_dict() == cfg.to_dict()
    assert report_arguments(cfg, 1, out.append) is None and len(out) == 1  # other ranks: nothing
    cfg.logging.tensorboard_dir = None
    cfg.checkpoint.save = None
    assert report_arguments(cfg, 0, out.append) is None and "end of arguments" in out[1]


def test_a_run_prints_the_arguments_averaged_lines_and_checkpoint_saves(tmp_path):
    args = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "1", "--train-iters", "4",
            "--log-interval", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(29600 + os.getpid() % 300), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "launch/pretrain_gpt.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert ARGUMENTS_RULE in out and "  train_iters ..................................... 4" in out
    with open(tmp_path / "ckpt" / "metrics.args.json") as fh:
        assert json.load(fh)["save_interval"] == 2
    lines = [x for x in out.splitlines() if STAMP.match(x)]
    assert len(lines) == 2 and " iteration        4/       4 | consumed samples:           64 |" in lines[1]
    with open(tmp_path / "ckpt" / "metrics.jsonl") as fh:
        recs = [json.loads(x) for x in fh]
    for line, pair in zip(lines, (recs[0:2], recs[2:4])):
        mean = sum(r["lm_loss"] for r in pair) / 2
        assert math.isclose(float(field(line, "lm loss")), mean, rel_tol=1e-6), (line, pair)
        rate = sum(r["tokens_per_sec"] * r["iter_time_s"] for r in pair) / sum(r["iter_time_s"] for r in pair)
        assert field(line, "tokens per second").startswith(f"{rate:,.0f} ("), (line, pair)
    assert f"saving checkpoint at iteration 2 into {tmp_path / 'ckpt'} ..." in out
    assert re.search(r"\nsaved checkpoint at iteration 4 in \d+\.\d\d s\n", out), out[-2000:]

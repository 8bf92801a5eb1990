"""The launcher's first five minutes: user mistakes end fast with one clear line, before any process group.

Under torchrun the worker exits 2 after printing the line once (rank 0); torchrun itself then reports
the worker's exit code 2 and exits 1 (torchrun's own convention, outside our control). Run directly,
`python launch/pretrain_gpt.py` exits 2.
"""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR = "pretrain_gpt.py: error:"


def launch(args, torchrun_procs=None, timeout=60):
    # `timeout` is a hang guard, not a speed claim: a mistake that waited on a process group or a
    # rendezvous would run into it and fail the test (wall-clock bounds flake on a loaded machine).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if torchrun_procs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(torchrun_procs),
               "launch/pretrain_gpt.py", *args]
    else:
        cmd = [sys.executable, "launch/pretrain_gpt.py", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def our_lines(proc):
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(ERROR)]


def test_tp_that_does_not_divide_heads_under_torchrun_fails_fast_with_one_line_per_problem():
    proc, _ = launch(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--tp", "3"], torchrun_procs=2)
    lines = our_lines(proc)
    assert len(lines) == 2, proc.stderr  # once (rank 0): the heads, and the world of 2
    assert "--tensor-model-parallel-size 3" in lines[0] and "choose a tp among" in lines[0]
    assert "does not divide the world size 2" in lines[1]
    assert "exitcode  : 2" in proc.stderr, "each worker must exit 2"
    assert proc.returncode != 0
    # torchrun prints its own report; no frame of ours (a traceback from the worker) may appear in it
    assert 'pretrain_gpt.py", line' not in proc.stderr and "engine/" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_direct_launch_mistakes_exit_2_with_their_own_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("num_layers: 2\nhiden_size: 64\n")
    cases = [  # every mistake of the command line, a line each
        (["--config", "configs/gpt-tiny.yaml", "--tp", "3"],
         ["--tensor-model-parallel-size 3: must divide", "does not divide the world size 1", "--data-path (none)"]),
        (["--config", "configs/gpt-tiny.yaml", "--mock-data", "--pp", "4"], ["--pipeline-model-parallel-size 4"]),
        (["--config", str(bad_yaml)], ["unknown key 'hiden_size'", "--data-path (none)"]),
        (["--config", "configs/gpt-tiny.yaml", "--data-path", str(tmp_path / "corpus")], ["--data-path"]),
        # a run flag checked by engine.validation.validate reaches the user the same way
        (["--config", "configs/gpt-tiny.yaml", "--mock-data", "--distributed-timeout-minutes", "0"],
         ["--distributed-timeout-minutes 0"]),
        # nccl needs CUDA: a CPU run that names it ends before any process group
        (["--config", "configs/gpt-tiny.yaml", "--mock-data", "--device", "cpu", "--distributed-backend", "nccl"],
         ["--distributed-backend nccl: NCCL runs on CUDA devices only"]),
    ]
    for args, needles in cases:
        proc, _ = launch(args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        lines = our_lines(proc)
        assert len(lines) == len(needles) and all(n in line for n, line in zip(needles, lines)), (args, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr


def test_world_size_not_tp_times_pp_times_dp_under_torchrun():
    proc, _ = launch(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--pp", "4"], torchrun_procs=2)
    lines = our_lines(proc)
    assert len(lines) == 1 and "does not divide the world size 2" in lines[0], proc.stderr
    assert "exitcode  : 2" in proc.stderr


@pytest.mark.slow
def test_pipeline_trace_is_written_per_rank_and_drawn(tmp_path):
    trace = tmp_path / "trace"
    proc, _ = launch(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--pp", "2", "--num-layers", "2",
                      "--train-iters", "3", "--global-batch-size", "8", "--pipeline-trace", str(trace)],
                     torchrun_procs=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    for rank in (0, 1):
        events = [json.loads(line) for line in open(f"{trace}.rank{rank}.jsonl")]
        assert {e["iteration"] for e in events} == {1, 2, 3}
        assert sum(e["kind"] == "F" for e in events) == 3 * 2  # 2 microbatches per iteration
        assert all(e["end"] >= e["start"] for e in events)
    png = tmp_path / "pipeline.png"
    plot = subprocess.run([sys.executable, "tools/plot_pipeline.py", str(trace), "--out", str(png)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.stat().st_size > 10_000


def test_batch_rampup_keeps_sampler_accumulation_and_lr_consistent(tmp_path):
    import json

    from engine.cli import parse_config
    from engine.data import BatchSizeSchedule
    from engine.optim import lr_at
    args = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "2", "--rampup-batch-size", "4", "4",
            "40", "--train-iters", "12", "--metrics-file", str(tmp_path / "m.jsonl")]
    proc, _ = launch(args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    records = [r for r in records if "event" not in r and "split" not in r]
    cfg = parse_config(args)
    ramp = BatchSizeSchedule(4, 4, 40, 16)  # gpt-tiny.yaml's global batch is 16
    consumed, sizes = 0, []
    for r in records:
        size = ramp.at(consumed)
        sizes.append(size)
        assert r["lr"] == lr_at(consumed / 16, cfg.optim, 12)  # Megatron's LR position under ramp-up: in samples
        consumed += size
        assert r["consumed_samples"] == consumed
    assert sizes[0] == 4 and sizes[-1] == 16 and sorted(sizes) == sizes, sizes

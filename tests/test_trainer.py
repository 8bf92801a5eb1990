"""The trainer end to end under torchrun: metrics contract, evaluation, TensorBoard, MFU, banner, profiler,
the stability guard's drills (nan skip, spike rollback) and a kill -9 restart that reproduces the loss curve.

Every run is a torchrun subprocess of a tiny model (2 layers, hidden 32, 32 tokens) with a hard timeout;
each job's processes carry a tag in their environment so that whatever is left of a job is found and
killed afterwards, whatever happened to torchrun. The module reuses one uninterrupted reference run
(4 ranks, tp 2 x pp 2, sequence parallel) for most checks. Budget on two cores: about 30 s, plus about
25 s for the restart case (marked slow).
"""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from harness import NO_DROPOUT


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
        "--seq-length", "32", "--max-position-embeddings", "32", "--log-interval", "1"]
TAG = "TERNION_TEST_JOB"
LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +\d+/ *\d+ \| ")  # engine.metrics.LogInterval


# ---------------------------------------------------------------------- running jobs
def _proc_env(pid: str) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        items = fh.read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def job_processes(tag: str) -> dict:
    """pid -> environment of every live (non-zombie) process of the job tagged `tag`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = _proc_env(pid)
            if env.get(TAG) != tag:
                continue
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            out[int(pid)] = env
        except (OSError, ValueError):
            continue
    return out


def worker_pid(tag: str, rank: int):
    """The pid of the job's training process of global rank `rank` (None while there is none)."""
    for pid, env in job_processes(tag).items():
        if env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return pid
    return None


def read_records(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def last_train_records(records: list) -> dict:
    """iteration -> the last training record of it (a resumed or rolled-back run rewrites iterations)."""
    return {r["iteration"]: r for r in records if "event" not in r and "split" not in r}


def checkpoint_holding(save_dir, iteration: int, into):
    """A --load directory (pathlib) holding only `iteration` of the run saved in `save_dir`, as if that run had
    stopped there."""
    import shutil
    name = f"iter_{iteration:07d}"
    shutil.copytree(save_dir / name, into / name)
    (into / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return into


def launch(args: list, nproc: int, *, timeout: float = 120, max_restarts: int = 0, watch=None, survivors=None,
           entry: str = "launch/pretrain_gpt.py", torchrun_args: tuple = ()):
    """Run `entry` (pretrain_gpt.py) under torchrun (with `torchrun_args` besides the usual ones); `watch(tag, elapsed)`
    is called every 50 ms while it runs.

    Returns (exit code, combined output, seconds). Nothing of the job survives this call: `survivors`, a
    list, receives the pids still alive 2 s after torchrun ended by itself, before they are killed.
    """
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{TAG: tag})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", *torchrun_args, entry, *args]
    log_path = os.path.join("/tmp", f"ternion-test-{tag}.log")
    start = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and not timed_out:
                elapsed = time.monotonic() - start
                timed_out = elapsed > timeout
                if watch is not None:
                    watch(tag, elapsed)
                time.sleep(0.05)
        finally:
            elapsed = time.monotonic() - start
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            elif survivors is not None:
                deadline = time.monotonic() + 2.0
                while job_processes(tag) and time.monotonic() < deadline:
                    time.sleep(0.1)
                survivors.extend(job_processes(tag))
            for pid in job_processes(tag):
                _signal(pid, signal.SIGKILL)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        output = fh.read()
    os.remove(log_path)
    assert not timed_out, f"job did not finish within {timeout} s:\n{output[-5000:]}"
    return proc.returncode, output, elapsed


def _signal(pid: int, sig) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:  # it ended meanwhile
        return False


def kill_when(metrics_path: str, iteration: int, rank: int, sig=signal.SIGKILL):
    """A watch that sends `sig` to rank `rank` once the metrics file has reached `iteration` (once)."""
    sent = []

    def watch(tag, _elapsed):
        if sent:
            return
        records = last_train_records(read_records(metrics_path))
        if records and max(records) >= iteration:
            pid = worker_pid(tag, rank)
            if pid is not None and _signal(pid, sig):
                sent.append((max(records), time.monotonic()))
    watch.sent = sent
    return watch


def single_thread_peak_tflops() -> float:
    """Best fp32 matmul rate of one thread here: an upper bound for what one single-threaded rank achieves."""
    from benchmarks.train import measured_matmul_tflops
    return measured_matmul_tflops("cpu", torch.float32, size=512, threads=1)


def tiny_model():
    """TINY's model on one rank, on the meta device (shapes only)."""
    from engine.config import ModelConfig
    from engine.model import GPTModel
    from engine.parallel.topology import ParallelContext
    m = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=32,
                    vocab_size=256, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                    position_embedding_type="rope", swiglu=True, disable_bias_linear=True)
    return GPTModel(m, ParallelContext.virtual(), device="meta")


# ---------------------------------------------------------------------- the reference run
REFERENCE = TINY + ["--tp", "2", "--pp", "2", "--sequence-parallel", "--train-iters", "12", "--save-interval", "4",
                    "--eval-interval", "4", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    peak = single_thread_peak_tflops()
    args = REFERENCE + ["--save", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"), "--peak-tflops",
                        f"{peak:.6f}", "--profile", "--profile-step-start", "5", "--profile-step-end", "6"]
    code, output, _ = launch(args, 4)
    assert code == 0, output[-8000:]
    return {"dir": out, "output": output, "peak": peak, "records": read_records(str(out / "tb" / "metrics.jsonl"))}


def test_metrics_file_holds_one_record_per_iteration_with_the_contract_keys(reference):
    from engine.metrics import TRAIN_KEYS
    train = [r for r in reference["records"] if "event" not in r and "split" not in r]
    assert [r["iteration"] for r in train] == list(range(1, 13))
    for r in train:
        assert set(TRAIN_KEYS) <= set(r), sorted(set(TRAIN_KEYS) - set(r))
        assert r["consumed_samples"] == 16 * r["iteration"] and r["skipped"] == 0
        assert math.isfinite(r["lm_loss"]) and r["grad_norm"] > 0 and r["tokens_per_sec"] > 0
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.05, "the model does not learn"
    assert not [r for r in reference["records"] if "event" in r], "an uneventful run logged events"
    lines = [line for line in reference["output"].splitlines() if LOG_LINE.match(line)]
    assert len(lines) == 12 and "lm loss: " in lines[0] and "(TFLOP/s/GPU): " in lines[0] and "MFU: " in lines[0]


def test_evaluation_writes_valid_records_and_tensorboard_scalars(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    valid = [r for r in reference["records"] if r.get("split") == "valid"]
    assert [r["iteration"] for r in valid] == [4, 8, 12]
    for r in valid:
        assert math.isfinite(r["lm_loss"]) and r["ppl"] == pytest.approx(math.exp(r["lm_loss"]), rel=1e-6)
    events = EventAccumulator(str(reference["dir"] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm-loss", "lr", "grad-norm", "loss-scale", "tokens-per-sec", "tflops-per-gpu", "mfu",
            "valid/lm-loss", "valid/ppl"} <= tags, tags
    tb_valid = {e.step: e.value for e in events.Scalars("valid/lm-loss")}
    assert tb_valid == pytest.approx({r["iteration"]: r["lm_loss"] for r in valid}, rel=1e-6)
    assert [e.step for e in events.Scalars("lm-loss")] == list(range(1, 13))
    assert "validation at iteration 8: loss" in reference["output"]


def test_mfu_is_model_flops_over_the_peak_and_never_above_one(reference):
    """Recount the model FLOPs from the real model's weights: a FLOP count inflated by the layout (tp, pp,
    world size) would show here, and against a measured single-thread peak it would push MFU above 1."""
    # every weight of 2 or more dimensions is a matmul's (fc1 of SwiGLU is [2, ffn, h]); the embedding is
    # the tied output layer's weight, and its lookup costs no FLOPs
    matmul_weights = sum(p.numel() for p in tiny_model().parameters() if p.ndim >= 2)
    s, h, layers, gbs = 32, 32, 2, 16
    flops = 3 * (2 * s * matmul_weights + 4 * s * s * h * layers) * gbs  # forward + 2x backward, full s^2
    for r in last_train_records(reference["records"]).values():
        assert r["tflops_per_gpu"] * 1e12 * r["iter_time_s"] * 4 == pytest.approx(flops, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / reference["peak"], rel=1e-4)
        assert 0 < r["mfu"] <= 1.0, r


def test_banner_counts_parameters_per_stage_and_estimates_memory(reference):
    total = sum(p.numel() for p in tiny_model().parameters())
    out = reference["output"]
    line = next(x for x in out.splitlines() if x.startswith("parameters:"))
    assert line.startswith(f"parameters: {total:,} in total"), line
    stages = [int(part.split(": ")[1].replace(",", "")) for part in line.split("per pipeline stage: ")[1].split(", ")]
    assert len(stages) == 2 and sum(stages) == total
    assert "batch: micro 4 x dp 1 x accumulation 4 = global 16" in out
    # on CPU the estimate is a process's, without the CUDA-context reserve a GPU's would add
    assert "memory per process (estimate, busiest stage" in out and "CUDA-context" not in out and "kernels: {" in out
    assert "pipeline schedule 1f1b (1 model chunk per rank)" in out
    assert " rank  node  tp  pp  dp" in out


def test_profiler_writes_a_trace_per_rank_into_the_tensorboard_dir(reference):
    traces = sorted(glob.glob(str(reference["dir"] / "tb" / "*.pt.trace.json")))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank0", "rank1", "rank2", "rank3"]
    with open(traces[0]) as fh:
        assert json.load(fh)["traceEvents"], "empty trace"


@pytest.mark.slow  # two torchrun starts of 4 ranks (~30 s): the restart's reproducibility is the point
def test_kill_9_under_max_restarts_resumes_and_reproduces_the_loss_curve(reference, tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    watch, survivors = kill_when(metrics, 5, rank=1), []
    code, output, _ = launch(REFERENCE + ["--save", str(tmp_path / "ckpt"), "--metrics-file", metrics], 4,
                             timeout=180, max_restarts=1, watch=watch, survivors=survivors)
    assert code == 0 and not survivors, output[-8000:]
    assert watch.sent and watch.sent[0][0] < 12, "the kill came too late: the run had finished"
    assert "resumed from" in output and "collective failed during" in output, output[-3000:]
    got, want = last_train_records(read_records(metrics)), last_train_records(reference["records"])
    assert sorted(got) == list(range(1, 13))
    assert [got[i]["lm_loss"] for i in range(1, 13)] == [want[i]["lm_loss"] for i in range(1, 13)]
    valid = lambda recs: {r["iteration"]: r["lm_loss"] for r in recs if r.get("split") == "valid"}  # noqa: E731
    assert valid(read_records(metrics)) == valid(reference["records"])


# ---------------------------------------------------------------------- the stability drills
@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    """2 ranks, pp 2 (the loss lives on the last stage): nan at step 3, a corrupted batch at step 9."""
    out = tmp_path_factory.mktemp("drills")
    args = TINY + ["--pp", "2", "--train-iters", "12", "--lr", "0.02", "--lr-warmup-iters", "0",
                   "--lr-decay-style", "constant", "--save", str(out), "--save-interval", "1",
                   "--inject-fault", "nan@3", "--inject-fault", "spike@9", "--spike-window", "5",
                   "--spike-threshold", "2", "--spike-rollback-after", "1", "--spike-lr-factor", "0.5",
                   "--spike-lr-steps", "2"]
    code, output, _ = launch(args, 2)
    assert code == 0, output[-8000:]
    return {"dir": out, "output": output, "records": read_records(str(out / "metrics.jsonl"))}


def _model_tensors(ckpt_dir):
    from safetensors.torch import load_file
    out = {}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "model_*.safetensors"))):
        out.update({f"{os.path.basename(path)}:{k}": v for k, v in load_file(path).items()})
    return out


def test_nan_fault_skips_exactly_that_step_and_training_continues(drills):
    records = drills["records"]
    skips = [r for r in records if r.get("event") == "skip"]
    assert len(skips) == 1 and skips[0]["iteration"] == 3, skips  # nan@3 hits the 3rd step
    train = [r for r in records if "event" not in r and "split" not in r]
    increments = [b["iteration"] for a, b in zip(train, train[1:]) if b["skipped"] > a["skipped"]]
    assert increments == [3] and train[-1]["skipped"] == 1
    assert next(r for r in train if r["iteration"] == 3)["lm_loss"] is None
    before, at, after = (_model_tensors(drills["dir"] / f"iter_{i:07d}") for i in (2, 3, 4))
    assert before.keys() == at.keys() and len(at) > 0
    assert all(torch.equal(before[k], at[k]) for k in at), "the skipped step changed the parameters"
    assert not all(torch.equal(at[k], after[k]) for k in at), "training did not continue after the skip"
    assert all(math.isfinite(r["lm_loss"]) for r in train if r["iteration"] > 3)
    assert "iteration 3: step skipped (non-finite loss)" in drills["output"]


def test_spike_fault_rolls_back_skips_its_data_and_lowers_the_lr(drills):
    records = drills["records"]
    spikes = [r for r in records if r.get("event") == "spike"]
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert [r["iteration"] for r in spikes] == [9] and spikes[0]["loss"] > spikes[0]["threshold"]
    assert len(rollbacks) == 1 and rollbacks[0]["iteration"] == 9 and rollbacks[0]["resumed_iteration"] == 8
    assert rollbacks[0]["skipped_to_samples"] == 9 * 16 and rollbacks[0]["lr_factor"] == 0.5
    train = [r for r in records if "event" not in r and "split" not in r]
    nines = [r for r in train if r["iteration"] == 9]
    assert len(nines) == 2, "iteration 9 must be redone after the rollback"
    redo = nines[1]
    assert redo["consumed_samples"] == 10 * 16, "the spiking batch was replayed instead of skipped"
    assert redo["lr"] == pytest.approx(0.01) and nines[0]["lr"] == pytest.approx(0.02)
    assert redo["lm_loss"] < spikes[0]["threshold"] and redo["rollbacks"] == 1
    lr = {r["iteration"]: r["lr"] for r in train}  # the last record of each iteration
    assert (lr[10], lr[11], lr[12]) == pytest.approx((0.01, 0.02, 0.02)), "LR x0.5 for 2 steps (9, 10), then back"
    assert [r["iteration"] for r in records if r.get("event") == "lr_restored"] == [11]
    assert train[-1]["iteration"] == 12
    assert "rolled back to the checkpoint of iteration 8" in drills["output"]


def test_profile_without_a_tensorboard_dir_is_refused_before_any_process_group():
    proc = subprocess.run([sys.executable, "launch/pretrain_gpt.py", *TINY, "--profile"], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("pretrain_gpt.py: error: --profile without --tensorboard-dir: add --tensorboard-dir "
                                   "DIR: the trace is written there")

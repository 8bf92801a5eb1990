"""Nothing lost (issue 21): one writer per --save, --save checked at start, Ctrl-C saves and exits 0, no
orphan outlives its torchrun agent, save failures named within seconds on every rank (disk full)."""
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from engine.checkpoint import files, latest_iteration
from engine.config import ConfigError
from engine.run.lock import LOCK_FILE, STALE_AFTER_S, RunLock
from harness import run_ranks
from test_trainer import TAG, TINY, job_processes, last_train_records, launch, read_records, worker_pid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ the lock on --save

def test_a_live_lock_refuses_a_second_job_and_is_given_back(tmp_path):
    with RunLock(str(tmp_path / "run")) as lock:
        held = json.load(open(lock.path))
        assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(ConfigError, match=rf"--save .*run is in use by another job \(host .*, pid {os.getpid()}"):
            RunLock(str(tmp_path / "run")).acquire()
    assert not os.path.exists(lock.path)


def _write_lock(path, **info):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(info, fh)


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = str(tmp_path / "a" / LOCK_FILE)
    _write_lock(path, host=socket.gethostname(), pid=dead.pid, started="earlier")
    lines = []
    RunLock(str(tmp_path / "a"), log=lines.append).acquire().release()
    assert len(lines) == 1 and f"pid {dead.pid} no longer runs" in lines[0] and "taking over" in lines[0]
    # another host: alive while it refreshes the lock, stale once silent for longer than STALE_AFTER_S
    path = str(tmp_path / "b" / LOCK_FILE)
    _write_lock(path, host="node-elsewhere", pid=1234, started="earlier")
    with pytest.raises(ConfigError, match="in use by another job"):
        RunLock(str(tmp_path / "b")).acquire()
    old = time.time() - STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lines = []
    RunLock(str(tmp_path / "b"), log=lines.append).acquire().release()
    assert "not refreshed for" in lines[0]


def test_an_unusable_save_directory_fails_at_start_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--save .*file/run: cannot create the directory \(Not a directory\)"):
        RunLock(str(blocker / "run")).acquire()


def _run(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "launch/pretrain_gpt.py", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_two_jobs_on_one_save_the_second_is_refused_and_ctrl_c_saves_and_exits_0(tmp_path):
    """The first job saves every iteration (synchronously), so Ctrl-C mostly lands during a save."""
    save = str(tmp_path / "run")
    args = TINY + ["--train-iters", "100000", "--save", save, "--save-interval", "1"]
    first = _run(args)
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(save, LOCK_FILE)) and time.monotonic() < deadline:
            time.sleep(0.1)
        second = _run(args)
        out, err = second.communicate(timeout=90)
        assert second.returncode == 2, err[-2000:]
        ours = [line for line in err.splitlines() if line.startswith("pretrain_gpt.py: error:")]
        assert len(ours) == 1 and f"--save {save} is in use by another job" in ours[0], err[-2000:]
        assert json.load(open(os.path.join(save, LOCK_FILE)))["pid"] == first.pid, "the lock stays the first job's"
        time.sleep(2.0)  # let the first job train a little
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    stop = [line for line in out.splitlines() if line.startswith("stopping at iteration")]
    assert stop and "signal SIGINT" in stop[0] and "to resume, run the same command" in stop[0], out[-2000:]
    iteration = int(stop[0].split()[3].rstrip(":"))
    assert latest_iteration(save) == iteration >= 1 and files.list_iterations(save)[-1] == iteration
    assert not os.path.exists(os.path.join(save, LOCK_FILE)), "the lock is given back at exit"


# ------------------------------------------------------------------ no orphans

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR1])
def test_workers_stop_when_their_torchrun_agent_is_killed(tmp_path, sig):
    """SIGKILL, or SIGUSR1 (which a plain torchrun does not handle), to the torchrun agent alone (its
    workers live in sessions of their own): they stop as if pre-empted, saving first, and are gone within
    their grace period."""
    save, tag = str(tmp_path / "run"), uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{TAG: tag})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval", "0.2", "launch/pretrain_gpt.py", *TINY, "--train-iters", "100000", "--save", save,
           "--save-interval", "100000", "--metrics-file", str(tmp_path / "m.jsonl")]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(tmp_path / "m.jsonl") and os.path.getsize(tmp_path / "m.jsonl") > 0):
            assert time.monotonic() < deadline and agent.poll() is None, "the job did not start training"
            time.sleep(0.2)
        workers = [worker_pid(tag, r) for r in (0, 1)]
        assert all(workers)
        agent.send_signal(sig)
        agent.wait(timeout=30)
        deadline = time.monotonic() + 75  # the workers' grace period (60 s) plus slack
        while any(_running(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived their agent"
            time.sleep(0.2)
    finally:
        for pid in job_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert latest_iteration(save) is not None, "the orphaned workers stopped cleanly and saved first"
    assert not os.path.exists(os.path.join(save, LOCK_FILE))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ save failures named at once

def _failing_save(rank, world, root, async_save):
    import torch

    from engine.checkpoint import saver
    from engine.checkpoint.saver import save_checkpoint
    from engine.config import Config
    from engine.optim import build_optimizer
    from engine.parallel.topology import build_context
    from engine.pipeline.partition import build_model_chunks
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length, cfg.model.vocab_size = 2, 32, 16, 64
    cfg.parallel.tensor_model_parallel_size = 2
    ctx = build_context(world, rank, 2, 1)
    chunks = build_model_chunks(cfg, ctx, vocab_size=64)
    opt = build_optimizer(cfg, chunks, ctx)
    # The ranks are pooled processes that later tests reuse: the full disk must not outlive this case.
    writers = {name: getattr(saver.files, name) for name in ("write_safetensors", "write_json_atomic")}
    if rank == 1:  # rank 1's disk is full: its shards and even its error marker cannot be written
        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        saver.files.write_safetensors = full
        saver.files.write_json_atomic = full
    start = time.monotonic()
    try:
        pending = save_checkpoint(root, 3, chunks, opt, ctx, cfg, {}, async_save=async_save)
        polls = 0
        while pending is not None and not pending.failed():  # the trainer asks once per iteration
            polls += 1
            time.sleep(0.05)
            assert polls < 200
        pending.finish()
    except RuntimeError as e:
        return str(e), time.monotonic() - start, torch.distributed.get_rank()
    finally:
        for name, writer in writers.items():
            setattr(saver.files, name, writer)
        ctx.destroy()
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_on_a_non_zero_rank_is_named_on_every_rank_within_seconds(tmp_path, async_save):
    results = run_ranks(_failing_save, 2, str(tmp_path / "run"), async_save, timeout=120)
    for message, seconds, _ in results:
        assert "failed on rank 1: OSError: [Errno 28] No space left on device" in message, message
        assert seconds < 30, f"reported after {seconds:.0f} s (the marker wait's timeout is 600 s)"
    assert files.list_iterations(str(tmp_path / "run")) == []


def test_a_really_full_disk_is_reported_as_such(tmp_path):
    """A 64 KiB tmpfs (where this test may mount one) holds the first checkpoint's directory, not its tensors."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        from test_checkpoint_tools import _tiny

        from engine.checkpoint import save_checkpoint
        cfg, ctx, chunks, opt = _tiny(hidden=64, layers=2)
        with pytest.raises(RuntimeError, match=r"failed on rank 0: OSError: \[Errno 28\] No space left on device"):
            save_checkpoint(str(mnt / "run"), 1, chunks, opt, ctx, cfg, {})
        assert latest_iteration(str(mnt / "run")) is None
    finally:
        subprocess.run(["umount", str(mnt)])


# ------------------------------------------------------------------ whole-job SIGKILL, three times

@pytest.mark.slow
def test_whole_job_sigkill_during_every_iteration_saves_resumes_the_uninterrupted_curve(tmp_path):
    """Every process of the job (agent and workers) SIGKILLed at random moments while it saves every
    iteration, three times: each restart resumes `latest` on every rank, and the losses equal an
    uninterrupted run's bitwise."""
    base = TINY + ["--pp", "2", "--train-iters", "40"]  # kills land a few iterations after they are due
    code, output, _ = launch(base + ["--metrics-file", str(tmp_path / "ref.jsonl")], 2, timeout=120)
    assert code == 0, output[-3000:]
    reference = {i: r["lm_loss"] for i, r in last_train_records(read_records(str(tmp_path / "ref.jsonl"))).items()}
    save, rng, runs = str(tmp_path / "run"), random.Random(21), []
    for _ in range(3):
        latest = latest_iteration(save)
        at, delay, sent = (latest or 0) + rng.randint(2, 3), rng.uniform(0.0, 0.3), []
        metrics = str(tmp_path / f"m{len(runs)}.jsonl")  # this launch's records only
        runs.append(metrics)

        def watch(tag, _elapsed, at=at, delay=delay, sent=sent, metrics=metrics):
            records = last_train_records(read_records(metrics))
            if not sent and records and max(records) >= at:
                time.sleep(delay)
                for pid in job_processes(tag):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # ended meanwhile
                        pass
                sent.append(max(records))
        code, output, _ = launch(base + ["--save", save, "--save-interval", "1", "--metrics-file", metrics], 2,
                                 timeout=120, watch=watch)
        assert sent, f"the job was not killed at iteration {at}:\n{output[-3000:]}"
        if latest is not None:
            assert f"resumed from {save} at iteration {latest} " in output, output[-3000:]
    latest = latest_iteration(save)
    runs.append(str(tmp_path / "final.jsonl"))
    code, output, _ = launch(base + ["--save", save, "--save-interval", "1", "--metrics-file", runs[-1]], 2,
                             timeout=120)
    assert code == 0, output[-3000:]
    assert f"resumed from {save} at iteration {latest} " in output and "taking over the lock" in output
    resumed = {}
    for path in runs:  # a later run's record of an iteration replaces an earlier one's
        resumed |= {i: r["lm_loss"] for i, r in last_train_records(read_records(path)).items()}
    assert resumed == reference

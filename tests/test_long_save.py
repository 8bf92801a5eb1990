"""Pre-emption with a long save: torchrun is stopped with SIGTERM while the job trains, and the save that signal
starts is slowed (benchmarks/slow_save.py). With a grace between SIGTERM and SIGKILL longer than the save
(`torchrun --shutdown-timeout`), the save completes and `latest` names it; with a shorter one, SIGKILL cuts the save
off and `latest` still names the previous complete checkpoint, the one a restart loads.
Budget: two torchrun jobs of 2 ranks, about 15 s each on an idle 2-core machine (slow: `make test` runs them).
"""
import dataclasses
import os
import re
import signal

import pytest
from torch.distributed.launcher.api import LaunchConfig

from engine.checkpoint import files, latest_iteration
from engine.checkpoint.reader import open_iteration
from test_trainer import TINY, job_processes, launch

SETTABLE = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
ENTRY = "benchmarks/slow_save.py"


def _stop_torchrun(save: str, grace: float, kill_by_hand: bool = False):
    """A watch that SIGTERMs the torchrun agent once the job has published a checkpoint; with `kill_by_hand`, it
    SIGKILLs every process of the job `grace` seconds later, as a torchrun without --shutdown-timeout would (at
    its fixed 30 s)."""
    sent = []

    def watch(tag, elapsed):
        if not sent and latest_iteration(save):
            agent = [pid for pid, env in job_processes(tag).items() if "TORCHELASTIC_RUN_ID" not in env]
            if agent:
                os.kill(agent[0], signal.SIGTERM)
                sent.append(elapsed)
        elif sent and kill_by_hand and elapsed > sent[0] + grace:
            for pid in job_processes(tag):
                os.kill(pid, signal.SIGKILL)
    watch.sent = sent
    return watch


def _run(tmp_path, monkeypatch, slow_s: float, grace: float, kill_by_hand: bool = False):
    save = str(tmp_path / "run")
    monkeypatch.setenv("TERNION_SLOW_SAVE_S", str(slow_s))
    watch = _stop_torchrun(save, grace, kill_by_hand)
    code, output, _ = launch(TINY + ["--train-iters", "100000", "--save", save, "--save-interval", "2"], 2,
                             timeout=180, watch=watch, entry=ENTRY,
                             torchrun_args=() if kill_by_hand else ("--shutdown-timeout", str(grace)))
    assert watch.sent, f"torchrun was never stopped:\n{output[-3000:]}"
    return save, output


@pytest.mark.slow
@pytest.mark.skipif(not SETTABLE, reason="this torch's torchrun has no --shutdown-timeout (torch 2.13 has it)")
def test_a_grace_longer_than_the_save_lets_the_signals_save_complete(tmp_path, monkeypatch):
    save, output = _run(tmp_path, monkeypatch, slow_s=3, grace=60)
    stop = re.search(r"stopping at iteration (\d+): signal SIGTERM; checkpoint saved in ", output)
    assert stop, output[-3000:]
    iteration = int(stop.group(1))
    saved = re.search(rf"saved checkpoint at iteration {iteration} in ([\d.]+) s", output)
    assert saved and float(saved.group(1)) >= 3, "the signal's save was the slowed one"
    assert latest_iteration(save) == iteration == files.list_iterations(save)[-1]
    assert not [name for name in os.listdir(save) if name.endswith(".tmp")]
    assert "slow_save.py: rank 0 exited with code 0" in output and "slow_save.py: rank 1 exited with code 0" in output
    assert "forcefully exiting" not in output, "torchrun did not need its SIGKILL"


@pytest.mark.slow
def test_a_grace_shorter_than_the_save_leaves_the_previous_checkpoint_as_latest(tmp_path, monkeypatch):
    """With --shutdown-timeout torchrun's own SIGKILL cuts the save off; without it (an older torch), the test
    kills the job at the moment torchrun would."""
    save, output = _run(tmp_path, monkeypatch, slow_s=30, grace=3, kill_by_hand=not SETTABLE)
    assert "stopping at iteration" not in output and "exited with code" not in output, output[-3000:]
    if SETTABLE:
        assert "forcefully exiting via 9" in output, output[-3000:]
    latest = latest_iteration(save)
    cut = [int(name[5:12]) for name in os.listdir(save) if name.endswith(".tmp")]
    assert latest and cut and cut[0] > latest, f"the signal's save was started and cut off: {os.listdir(save)}"
    # what a restart loads: `latest`, complete, every file as its metadata recorded it
    assert files.list_iterations(save)[-1] == latest == open_iteration(save).iteration

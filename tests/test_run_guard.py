"""engine/run/guard.py on its own: the lines a failing rank prints, its exit codes, and the lock given back.

The launcher tests reach these paths through whole jobs; here each is one call, so a change to a line or to
the order of "print, give back, exit" fails in a second.
"""
import os
import subprocess
import sys

import pytest

from engine.run.guard import Guard, fail, is_collective_failure, restart_store
from engine.run.lock import LOCK_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DIE = """
import sys
from engine.run.guard import Guard
guard = Guard(0, 2.5).take_lock(sys.argv[1])
guard.where = "the optimizer step of iteration 3"
try:
    raise {error}
except Exception as e:
    guard.die(e)
"""


def _die(tmp_path, error: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCHELASTIC_RUN_ID", None)
    return subprocess.run([sys.executable, "-c", DIE.format(error=error), str(tmp_path / "save")],
                          capture_output=True, text=True, env=env, timeout=120)


def test_a_mistake_is_one_line_from_rank_0_and_exit_2(capsys):
    assert fail("--lr must be positive", 0) == 2
    assert fail("--lr must be positive", 1) == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --lr must be positive\n"


@pytest.mark.parametrize("error, collective", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
    (RuntimeError("NCCL communicator was aborted"), True),
    (RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"), False),
    (ValueError("Timed out"), False),
])
def test_collective_failures_are_told_from_the_ranks_own_errors(error, collective):
    assert is_collective_failure(error) is collective


def test_a_failed_collective_is_one_line_exit_1_and_the_lock_is_given_back(tmp_path):
    proc = _die(tmp_path, 'RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer. '
                          'Check the network.")')
    assert proc.returncode == 1
    assert proc.stderr == ("pretrain_gpt.py: rank 0: collective failed during the optimizer step of iteration 3: "
                           "Connection closed by peer. (a peer rank died or stalled; "
                           "--distributed-timeout-minutes 2.5); stopping\n")
    assert not os.path.exists(tmp_path / "save" / LOCK_FILE)


def test_any_other_failure_prints_its_traceback_then_the_line(tmp_path):
    proc = _die(tmp_path, 'ValueError("bad shape\\nmore detail")')
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert proc.stderr.endswith("pretrain_gpt.py: rank 0: ValueError during the optimizer step of iteration 3: "
                                "bad shape; stopping\n")
    assert not os.path.exists(tmp_path / "save" / LOCK_FILE)


def test_only_rank_0_takes_the_lock_and_release_gives_it_back(tmp_path):
    Guard(1, 10).take_lock(str(tmp_path / "other"))
    assert not os.path.exists(tmp_path / "other")
    guard = Guard(0, 10).take_lock(str(tmp_path / "save"))
    assert os.path.exists(tmp_path / "save" / LOCK_FILE)
    guard.release()
    guard.release()
    assert not os.path.exists(tmp_path / "save" / LOCK_FILE)


def test_outside_torchrun_there_is_no_restart_prefix(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_store(0, 1, None) is None

"""Fault tolerance under torchrun: a killed rank ends the job (no hang, no survivor), a pre-emption signal
saves and exits 0. (The kill -9 restart that resumes and reproduces the loss curve is in test_trainer.py,
beside the reference run it compares with.) Budget: about 25 s on two cores.
"""
import os
import re
import signal
import time

import pytest

from test_trainer import TINY, kill_when, last_train_records, launch, read_records

TIMEOUT_MINUTES = 0.25


@pytest.mark.slow
def test_sigkill_of_a_rank_without_restarts_ends_the_job_naming_the_failure(tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    watch = kill_when(metrics, 2, rank=1)
    survivors = []
    args = TINY + ["--pp", "2", "--train-iters", "10000", "--metrics-file", metrics,
                   "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    code, output, _ = launch(args, 2, timeout=120, max_restarts=0, watch=watch, survivors=survivors)
    assert watch.sent, f"rank 1 was never killed:\n{output[-3000:]}"
    after_kill = time.monotonic() - watch.sent[0][1]
    assert code != 0
    assert after_kill < 60 * TIMEOUT_MINUTES + 15, f"the job took {after_kill:.1f} s to end after the kill"
    ours = [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: rank 0: collective failed")]
    assert len(ours) == 1, output[-3000:]
    # the line names the operation and the group it was talking to (which one depends on when the kill lands)
    assert re.search(r"during .+ \((.*(pp|tp|dp) group \[[\d, ]+\]|all ranks)", ours[0]), ours[0]
    assert "--distributed-timeout-minutes 0.25" in ours[0]
    assert re.search(r"\(rank 1 on host \S+ stopped answering \d+ s ago \(during .+\);", ours[0]), ours[0]
    assert "rank 0 " not in ours[0].split("(", 1)[1], "the survivor is not a suspect"
    assert re.search(r"; last collective: ((pp|cp|tp|dp|ep) )?[\w/]+ (over|with) ", ours[0]), ours[0]
    assert 'pretrain_gpt.py", line' not in output and 'engine/' not in output, "a rank printed a traceback"
    assert "Signal 9 (SIGKILL)" in output, "torchrun's report should name the killed rank"
    assert not survivors, f"processes of the job outlived torchrun: {survivors}"


def test_preemption_signal_finishes_the_step_saves_and_exits_zero(tmp_path):
    """SIGUSR1 reaches one rank only (rank 1); every rank stops at the same step and rank 0 saves."""
    metrics, save = str(tmp_path / "metrics.jsonl"), str(tmp_path / "ckpt")
    watch = kill_when(metrics, 2, rank=1, sig=signal.SIGUSR1)
    args = TINY + ["--pp", "2", "--train-iters", "10000", "--save", save, "--metrics-file", metrics]
    code, output, _ = launch(args, 2, timeout=120, watch=watch)
    assert watch.sent and code == 0, output[-3000:]
    last = max(last_train_records(read_records(metrics)))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as fh:
        assert int(fh.read()) == last
    assert os.path.isdir(os.path.join(save, f"iter_{last:07d}"))
    assert f"stopping at iteration {last}: another rank was asked to stop; checkpoint saved" in output

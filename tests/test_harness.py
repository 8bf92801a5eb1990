"""The multi-rank harness: results, failures, deadlocks and the gloo abort at exit."""
import atexit
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, RankPool, run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _deadlock(rank, world):
    t = torch.zeros(1)
    dist.recv(t, src=1 - rank)  # both ranks wait for the other: a true deadlock


def _die(rank, world):
    if rank == 0:
        os._exit(3)
    time.sleep(30)


def _abort_at_exit(rank, world):
    atexit.register(os.abort)
    return "ok"


def test_results_come_back_per_rank():
    assert run_ranks(_sum_ranks, 2) == [3.0, 3.0]


def test_exception_on_one_rank_fails_with_its_traceback():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(_raise_on_rank1, 2, timeout=60)


def test_deadlock_fails_within_timeout_with_every_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_deadlock, 2, timeout=5)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    print(msg)
    assert elapsed < 30, elapsed  # 5 s timeout + stack collection, with room for a loaded machine
    assert "did not finish within 5s" in msg
    assert "--- rank 0 ---" in msg and "--- rank 1 ---" in msg
    assert msg.count("_deadlock") >= 2, "both ranks' stacks must show the deadlocked frame"


def test_dead_rank_is_a_failure():
    with pytest.raises(RankFailure, match="died"):
        run_ranks(_die, 2, timeout=60)


def test_abort_after_successful_teardown_is_tolerated():
    pool = RankPool(2)
    try:
        assert pool.run(_abort_at_exit, (), timeout=60) == ["ok", "ok"]
    finally:
        pool.close()
    assert all(p.exitcode != 0 for p in pool.procs), "the simulated gloo abort did happen"

"""Checkpoints across context-parallel sizes, under torchrun with the distributed optimizer.

CP shards no weights, but the optimizer shards over dp x cp: a run at cp 1 (2 ranks: 2 shards) saves at
iteration 4; a run at cp 2 (4 ranks: 4 shards) resumes from it and saves at 8; a run at cp 1 resumes from
that. Each resumed run's losses equal the uninterrupted cp 1 run's within 1e-4 (10 and more of them).
Budget: three small torchrun jobs, about 30 s.
"""
import pytest

from test_trainer import TINY, checkpoint_holding, last_train_records, launch, read_records

MODEL = TINY + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                "--num-query-groups", "2", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "18",
                "--use-distributed-optimizer", "--save-interval", "4"]


def _losses(metrics) -> dict:
    return {i: r["lm_loss"] for i, r in last_train_records(read_records(str(metrics))).items()}


@pytest.mark.slow
def test_resume_cp1_to_cp2_and_back_continues_the_curve(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    code, out, _ = launch(MODEL + ["--save", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], 2,
                          timeout=180)
    assert code == 0, out[-6000:]
    want = _losses(tmp_path / "a.jsonl")
    assert sorted(want) == list(range(1, 19)) and want[18] < want[1]

    load = checkpoint_holding(tmp_path / "a", 4, tmp_path / "b")
    code, out, _ = launch(MODEL + ["--cp", "2", "--load", str(load), "--save", str(tmp_path / "b-save"),
                                   "--metrics-file", str(tmp_path / "b.jsonl")], 4, timeout=180)
    assert code == 0, out[-6000:]
    assert "x cp 2 (p2p)" in out and f"resumed from {load} at iteration 4" in out
    got = _losses(tmp_path / "b.jsonl")
    assert sorted(got) == list(range(5, 19))
    assert max(abs(got[i] - want[i]) for i in got) <= 1e-4, (got, want)

    load = checkpoint_holding(tmp_path / "b-save", 8, tmp_path / "c")
    code, out, _ = launch(MODEL + ["--load", str(load), "--metrics-file", str(tmp_path / "c.jsonl")], 2, timeout=180)
    assert code == 0, out[-6000:]
    got = _losses(tmp_path / "c.jsonl")
    assert sorted(got) == list(range(9, 19))
    assert max(abs(got[i] - want[i]) for i in got) <= 1e-4, (got, want)

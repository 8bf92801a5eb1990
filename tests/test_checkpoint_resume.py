"""Resume under torchrun from a checkpoint saved at tp 2 x pp 1 x dp 2 with the distributed optimizer:
at the same layout the next 10 losses are bitwise those of the uninterrupted run; at tp 1 x pp 2 x dp 2 (the
optimizer's dp shards cut from other tensor-parallel parts) and tp 4 x pp 1 x dp 1 (distributed optimizer off,
vocabulary padded differently) the checkpoint is resharded at load and the next 10 losses agree within 1e-4.
Budget: four 4-rank jobs, about 40 s (8-rank jobs took 75 s here, half of it starting processes; the sharded
optimizer's resharding across dp sizes and strategies is tests/test_sharded_dp.py's, in process).
"""
import os
import shutil

import pytest

from test_trainer import TINY, last_train_records, launch, read_records

MODEL = TINY + ["--num-layers", "4", "--num-query-groups", "4", "--micro-batch-size", "1", "--global-batch-size", "4",
                "--make-vocab-size-divisible-by", "24", "--train-iters", "14"]
SAVED_AT = 4


def _losses(metrics: str) -> dict:
    return {i: r["lm_loss"] for i, r in last_train_records(read_records(metrics)).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    args = MODEL + ["--tp", "2", "--pp", "1", "--use-distributed-optimizer", "--save-interval", str(SAVED_AT),
                    "--save", str(out / "ckpt"), "--metrics-file", str(out / "metrics.jsonl")]
    code, output, _ = launch(args, 4, timeout=180)
    assert code == 0, output[-8000:]
    return out


@pytest.mark.slow  # each case is a 4-process torchrun job (~10 s on two cores)
@pytest.mark.parametrize("tp,pp,extra,tolerance", [
    (2, 1, ["--use-distributed-optimizer"], 0.0),
    (1, 2, ["--use-distributed-optimizer"], 1e-4),
    (4, 1, [], 1e-4),
])
def test_resume_at_another_layout_continues_the_loss_curve(uninterrupted, tmp_path, tp, pp, extra, tolerance):
    # A checkpoint directory holding only the early iteration, as if the run had stopped there.
    load = tmp_path / "load"
    shutil.copytree(uninterrupted / "ckpt" / f"iter_{SAVED_AT:07d}", load / f"iter_{SAVED_AT:07d}")
    (load / "latest_checkpointed_iteration.txt").write_text(f"{SAVED_AT}\n")
    metrics = str(tmp_path / "metrics.jsonl")
    code, output, _ = launch(MODEL + ["--tp", str(tp), "--pp", str(pp), *extra, "--load", str(load),
                                      "--metrics-file", metrics], 4, timeout=180)
    assert code == 0, output[-8000:]
    assert f"resumed from {load} at iteration {SAVED_AT}" in output
    # a resume under another layout says so (and that its RNG streams are fresh); the same layout's does not
    assert ("resharded from tp 2 x pp 1 x dp 2 (fresh RNG streams)" in output) == ((tp, pp) != (2, 1)), output[-3000:]
    got, want = _losses(metrics), _losses(str(uninterrupted / "metrics.jsonl"))
    assert sorted(got) == list(range(SAVED_AT + 1, 15))
    worst = max(abs(got[i] - want[i]) for i in got)
    assert worst <= tolerance, (worst, got, want)
    assert sorted(os.listdir(load)) == [f"iter_{SAVED_AT:07d}", "latest_checkpointed_iteration.txt"], \
        "loading must not write into --load"

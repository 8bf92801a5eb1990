"""A spike rollback under a post-validated schedule (issue 37): zb-v steps before its check and learns of a spike one
iteration late, while the next iteration is already running; it must still roll back to the checkpoint before the
iteration that spiked, skip exactly that iteration's batch (the next one replays), and so follow 1F1B's rollback
events and loss curve. Two ranks (pp 2), the trainer in-process, each schedule once. Budget: about 15 s.
"""
import json

import pytest

from harness import run_ranks, train_logged

ARGS = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "4", "--hidden-size", "32",
        "--seq-length", "32", "--max-position-embeddings", "32", "--log-interval", "1", "--pp", "2",
        "--train-iters", "12", "--lr", "0.02", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
        "--save-interval", "4", "--inject-fault", "spike@10", "--spike-window", "5", "--spike-threshold", "2",
        "--spike-rollback-after", "1", "--spike-lr-factor", "0.5", "--spike-lr-steps", "2", "--clip-grad", "0"]
# No clipping: every zb-v step is speculative (after a clipped one, steps wait for their check until one passes,
# which would take the spiking step synchronously and test nothing).


def _train(rank, world, runs):
    from engine.cli import parse_config
    from engine.layout import Layout
    from engine.parallel.topology import context_for
    from engine.resolve import resolve
    from engine.validation import validate
    lines = []
    for argv in runs:
        cfg = parse_config(argv)
        validate(cfg, world)
        ctx = context_for(Layout.from_config(resolve(cfg, world), world), rank, seed=cfg.training.seed)
        assert ctx.layout.schedule.split_backward == (cfg.parallel.pipeline_schedule == "zb-v")  # zb-v post-validates
        lines += train_logged(cfg, ctx)
    return lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollback")
    argv = {s: ARGS + ["--pipeline-schedule", s, "--save", str(root / s), "--metrics-file", str(root / f"{s}.jsonl")]
            for s in ("zb-v", "1f1b")}
    lines = run_ranks(_train, 2, list(argv.values()), timeout=300)
    out = {}
    for s in argv:
        with open(root / f"{s}.jsonl") as fh:
            out[s] = [json.loads(line) for line in fh]
    return out, lines


def test_zb_v_rolls_back_to_the_spiking_iteration_and_skips_exactly_its_batch_like_1f1b(runs):
    records, _ = runs
    events = {s: [{k: v for k, v in r.items() if k not in ("time", "timestamp")} for r in rs if "event" in r]
              for s, rs in records.items()}
    rollbacks = [e for e in events["1f1b"] if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["iteration"] == 10 and rollbacks[0]["resumed_iteration"] == 8
    assert rollbacks[0]["skipped_to_samples"] == 10 * 16  # iteration 10's batch, and only it
    assert events["zb-v"] == events["1f1b"]
    train = {s: [r for r in rs if "event" not in r and "split" not in r] for s, rs in records.items()}
    assert [r["iteration"] for r in train["zb-v"]] == [r["iteration"] for r in train["1f1b"]]
    assert [r["iteration"] for r in train["1f1b"]] == list(range(1, 11)) + [9, 10, 11, 12]
    for a, b in zip(train["zb-v"], train["1f1b"]):
        assert a["consumed_samples"] == b["consumed_samples"] and a["lr"] == b["lr"], (a, b)
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], abs=1e-6), (a, b)


def test_the_console_names_the_iteration_that_spiked(runs):
    _, lines = runs
    said = [line for line in lines[0] if "rolled back to the checkpoint" in line]
    assert len(said) == 2 and all(line.startswith("iteration 10: rolled back to the checkpoint of iteration 8; data "
                                                  "skipped to sample 160") for line in said), said

"""With --async-save, a run that stops (pre-emption, --exit-interval) says its checkpoint is saved before the stop
line that says so (issue 37: the stop line came first). One rank in-process. About 5 s."""
from harness import run_ranks, train_logged

ARGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "64", "--make-vocab-size-divisible-by", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
        "--train-iters", "10", "--exit-interval", "3", "--async-save"]


def _run(rank, world, save):
    from engine.cli import parse_config
    from engine.parallel.topology import build_context
    from engine.resolve import resolve
    from engine.validation import validate
    cfg = parse_config(ARGS + ["--save", save])
    validate(cfg, world)
    return train_logged(cfg, build_context(world, rank, 1, 1, seed=resolve(cfg, world).training.seed))


def test_the_async_saved_line_comes_before_the_stop_line(tmp_path):
    lines = run_ranks(_run, 1, str(tmp_path / "save"), timeout=120)[0]
    saved = [i for i, line in enumerate(lines) if line.startswith("saved checkpoint at iteration 3 in ")]
    stop = [i for i, line in enumerate(lines) if line.startswith("stopping at iteration 3: --exit-interval 3; "
                                                                 "checkpoint saved in")]
    assert len(saved) == 1 and len(stop) == 1 and saved[0] < stop[0], lines
    assert lines[saved[0]].endswith("(async)")

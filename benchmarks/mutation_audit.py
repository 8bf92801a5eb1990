"""The mutation audit of issue 37: one realistic bug at a time, and the `make test-fast` test that must catch it.

    python benchmarks/mutation_audit.py [--only NAME ...]

Each mutation is a text replacement in one engine file (it must match exactly once). The repository's tracked
files are copied into a temporary directory, the mutation applied there (the working tree is never touched), and
the named non-slow tests run in that copy (tests/conftest.py puts the copy first on the path). First the same
tests run unmutated and must pass; then each mutation must make them fail. Prints a table: mutation, the tests,
caught or survived, seconds.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, old text, new text, tests): tests as pytest arguments; old and new may be tuples of replacements
MUTATIONS = [
    ("ZeRO-3 load without writing the weights back into the shards", "engine/checkpoint/loader.py",
     "optimizer.full_weights(writeback=True)", "optimizer.full_weights(writeback=False)",
     ["tests/test_sharded_dp.py", "-k", "zero3_becomes"]),
    ("MoE expert-bias update with its sign flipped", "engine/moe/stats.py",
     "torch.sign(c.mean() - c)", "torch.sign(c - c.mean())", ["tests/test_moe_oracle.py"]),
    ("aux-loss coefficient dropped from the gradient", "engine/moe/router.py",
     "aux = scale * (probs.sum(0) * counts).sum()", "aux = scale / coeff * (probs.sum(0) * counts).sum()",
     ["tests/test_moe_oracle.py"]),
    ("post-validation ignores an fp16 loss-scale change", "engine/optim/post_validation.py",
     "moved = opt.scaler.scale != p.scale", "moved = False", ["tests/test_post_validation.py"]),
    ("last-epoch threshold 80% moved to 85%", "engine/data/gpt_dataset.py",
     "SEPARATE_FINAL_EPOCH_BELOW = 0.80", "SEPARATE_FINAL_EPOCH_BELOW = 0.85",
     ["tests/test_data_gpt.py", "-k", "last_epoch"]),
    ("last-epoch rule '<' made '<='", "engine/data/gpt_dataset.py",
     "return num_samples - before_last < int(", "return num_samples - before_last <= int(",
     ["tests/test_data_gpt.py", "-k", "last_epoch"]),
    ("ranks ignore rank 0's resume decision", "engine/checkpoint/resume.py",
     "decision = _decide(ck, latest) if rank == 0 else None\n    decision = all_gather_object(decision)[0]",
     "decision = all_gather_object(_decide(ck, latest))[rank]",
     ["tests/test_resume_safety.py", "-k", "rank_zeros"]),
    ("the sequence-parallel linear also keeps the gathered input", "engine/parallel/mappings.py",
     ("        ctx.save_for_backward(x, weight)\n        return F.linear(_gather_seq(x, group),",
      "        x, weight = ctx.saved_tensors\n"),
     ("        full = _gather_seq(x, group)\n        ctx.save_for_backward(x, weight, full)\n"
      "        return F.linear(full,", "        x, weight = ctx.saved_tensors[:2]\n"),
     ["tests/test_memory.py", "-k", "sequence_parallel_linear or only_its_shard"]),
    ("a rollback under zb-v names the iteration in progress and skips its batch", "engine/training.py",
     "self.rollback(o.iteration, o.consumed)", "self.rollback(self.iteration, self.consumed)",
     ["tests/test_rollback_schedules.py"]),
    ("--async-save: the stop line before the 'saved' line", "engine/training.py",
     "                self.checkpointer.finalize()\n", "", ["tests/test_async_stop.py"]),
    ("a survivor that reported is named as the culprit", "engine/run/liveness.py",
     "if r != self.rank and r not in reporters]", "if r != self.rank]", ["tests/test_liveness.py"]),
    ("resume ignores a changed --rotary-base", "engine/config/model_changes.py",
     '"make_vocab_size_divisible_by", "moe_router_dtype"})',
     '"make_vocab_size_divisible_by", "moe_router_dtype", "rotary_base"})', ["tests/test_resume_model.py"]),
]


def _copy_tree(into: str) -> None:
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split("\n")
    for rel in filter(None, tracked):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(into, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(into, rel))


def _run_tests(tree: str, tests: list) -> tuple:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                           "-p", "no:warnings", *tests], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=900)
    return done.returncode, time.monotonic() - start, (done.stdout + done.stderr).strip().splitlines()[-1:]


def _apply(tree: str, path: str, old, new) -> str:
    full = os.path.join(tree, path)
    original = text = open(full).read()
    for a, b in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        if text.count(a) != 1:
            raise SystemExit(f"mutation text found {text.count(a)} times in {path}: {a!r}")
        text = text.replace(a, b)
    with open(full, "w") as fh:
        fh.write(text)
    return original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="substrings of the mutations' names to run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(s in m[0] for s in args.only)]
    rows, failures = [], 0
    with tempfile.TemporaryDirectory(prefix="ternion-mutants-") as tree:
        _copy_tree(tree)
        for name, path, old, new, tests in chosen:
            code, seconds, tail = _run_tests(tree, tests)
            if code != 0:
                rows.append((name, " ".join(tests), f"baseline FAILS ({tail})", seconds))
                failures += 1
                continue
            original = _apply(tree, path, old, new)
            try:
                code, seconds, tail = _run_tests(tree, tests)
            finally:
                with open(os.path.join(tree, path), "w") as fh:
                    fh.write(original)
            caught = code != 0
            failures += not caught
            rows.append((name, " ".join(tests), "caught" if caught else "SURVIVED", seconds))
            print(f"{rows[-1][2]:9} {seconds:6.1f} s  {name}", flush=True)
    print("\n| mutation | tests (non-slow) | result | s |\n|---|---|---|---|")
    for name, tests, result, seconds in rows:
        print(f"| {name} | `{tests}` | {result} | {seconds:.0f} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

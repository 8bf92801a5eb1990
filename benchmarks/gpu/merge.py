"""Several gpu-check runs on one card as one results file: what a lease's minutes allowed, put together.

    python -m benchmarks.gpu.merge OUT.json RUN1.json RUN2.json ... [--commits SHA1,SHA2,...]
                                   [--pytest-log "GROUP=FILE@SHA" ...]

A later run's section replaces an earlier run's section of the same name (a rerun after a fix, or with a
larger budget); sections a later run left out (`--only`) are kept from the earlier one. In a section whose rows
name their model (`family`: the training section's), the later run replaces the rows, figures, notes and skips
of the models it measured and keeps the earlier run's of the others (a rerun `--models gpt2` adds GPT-2's rows
beside the Llama ones), each kept row marked with its run. Each section is
marked with the run it came from, and `runs` lists every run (its command, commit, date and seconds); a run
without the card section takes the card of those with it (they must be of one lease). A `pytest -m gpu` group
run by hand on the same lease (its `-v` output saved to FILE) is added to the correctness section as its own
row, counted from its PASSED/FAILED lines, in place of a run's row of the same group (one killed for time).
The goals are evaluated again over the merged sections.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.gpu import goals
from benchmarks.gpu.correctness import verbose_summary


UNNAMED = "unknown card"  # gpu_check's name for the card of a run without the card section


def merge(runs: list, commits: list, pytest_logs: list) -> dict:
    """One results dict from `runs` (gpu_check.json dicts, oldest first) and (group, text, commit) logs."""
    cards = {r["card"] for r in runs} - {UNNAMED}  # a run --only'd without its card section names none
    if len(cards) > 1:
        raise ValueError(f"the runs are of different cards ({', '.join(sorted(cards))}): merge one card's runs")
    if not cards:
        raise ValueError("no run names its card: include a run with the card section")
    sections = {}
    for i, run in enumerate(runs):
        for name, section in run["sections"].items():
            sections[name] = by_model(sections.get(name), {**section, "run": i + 1})
    for group, text, commit in pytest_logs:
        summary = {**verbose_summary(text), "group": group, "source": f"pytest -m gpu -v by hand, commit {commit}"}
        correctness = sections.setdefault("correctness", {"status": "ok", "figures": {}, "tables": {}, "notes": [],
                                                          "skipped": {}})
        rows = correctness["tables"].setdefault("pytest_gpu", [])
        rows[:] = [r for r in rows if r.get("group") != group] + [summary]  # replaces a run's killed group
    last = next(r for r in reversed(runs) if r["card"] != UNNAMED)  # its card, date and save_as name the file
    merged = {**last, "sections": sections, "command": "merged: see runs",
              "runs": [{"run": i + 1, "command": r["command"], "commit": c, "date": r["date"], "mode": r["mode"],
                        "total_s": r["total_s"], "sections": list(r["sections"])}
                       for i, (r, c) in enumerate(zip(runs, commits))],
              "pytest_logs": [{"group": g, "commit": c} for g, _, c in pytest_logs],
              "total_s": round(sum(r["total_s"] for r in runs), 1)}
    merged["goals"] = goals.evaluate(sections, last["mode"])
    return merged


def _models(section: dict) -> set:
    return {row["family"] for rows in section.get("tables", {}).values() for row in rows if "family" in row}


def by_model(earlier, later: dict) -> dict:
    """`later` over `earlier` (one section of two runs): whole, unless its rows name their model; then only the
    models `later` measured are replaced."""
    if earlier is None or not _models(later):
        return later
    fresh = _models(later)
    kept = _models(earlier) - fresh

    def ours(key: str) -> bool:  # a figure, note or skip of a kept model ("llama_micro_batch", "llama engine ...")
        return key.replace("_", " ").split(" ")[0] in kept

    tables = {key: [{**row, "run": row.get("run", earlier["run"])} for row in earlier["tables"].get(key, [])
                    if row.get("family") in kept]
                   + [{**row, "run": later["run"]} for row in later["tables"].get(key, [])]
              for key in {**earlier["tables"], **later["tables"]}}
    skipped = {**{k: v for k, v in earlier["skipped"].items() if ours(k)},
               **{k: v for k, v in later["skipped"].items() if not ours(k)}}
    return {**later, "tables": tables, "skipped": skipped,
            "figures": {**{k: v for k, v in earlier["figures"].items() if ours(k)}, **later["figures"]},
            "notes": [n for n in earlier["notes"] if ours(n)] + later["notes"],
            "status": later["status"] if later["status"] not in ("ok", "partial") else "partial" if skipped else "ok"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu/merge.py", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("runs", nargs="+", metavar="RUN.json")
    p.add_argument("--commits", default="", help="comma-separated commit of each run, in the same order")
    p.add_argument("--pytest-log", action="append", default=[], metavar="GROUP=FILE@SHA")
    args = p.parse_args(argv)
    commits = [c for c in args.commits.split(",") if c] or ["unrecorded"] * len(args.runs)
    if len(commits) != len(args.runs):
        print(f"--commits: {len(commits)} given for {len(args.runs)} runs; give one per run", file=sys.stderr)
        return 2
    try:
        runs = [json.load(open(path)) for path in args.runs]
        logs = []
        for spec in args.pytest_log:
            group, rest = spec.split("=", 1)
            path, commit = rest.rsplit("@", 1) if "@" in rest else (rest, "unrecorded")
            logs.append((group, open(path).read(), commit))
        merged = merge(runs, commits, logs)
    except (OSError, ValueError, KeyError) as exc:
        print(f"benchmarks/gpu/merge.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The first real GPU run in one prepared, unattended command (issue 31): the card's roofs, correctness on the
device, the kernels, one-GPU training against plain PyTorch, transformers and torch.compile, memory against the
planner, FP8 (the GEMM against bf16, the 1.3B step in FP8 against bf16), and the goals table.

    PYTHONPATH=. python -m benchmarks.gpu_check [--quick] [--out DIR] [--device cuda|cpu] [--dry-run]
    python -m benchmarks.gpu_check --table RESULTS.json      # docs/evidence.md's "Measured on GPU" table

Run from the repository's root as a module: the checkout's engine is used whether or not it is installed
(PYTHONPATH=. carries that to the processes it starts: pytest -m gpu's torchrun jobs)

Needs only torch (a CUDA build), triton and transformers, and installs nothing: a lease's machine reaches no
registry. Full: within 8 minutes; --quick: within 4 (issue 31's bounds, which leave a 15-minute lease room for a
rerun); the launch-setting sweep (`tuning`) runs only when --only names it. --only runs the sections named, and
--budgets gives them other seconds: such a run may take up to 10 minutes (a lease's limit for one command). Each
section runs in its own process under a time budget (benchmarks/gpu/runner.py); one that fails, crashes or runs
out of time is recorded with its error and the rest go on. Writes gpu_check.json and gpu_check.md into --out (default $OUT, else ./gpu_check_out) and prints
the Markdown table last, since a lease returns only the output's tail. The JSON names the file it is to be
committed as, benchmarks/results/gpu-<card>-<date>.json.

--dry-run runs the same code at tiny sizes: `--device cpu --dry-run` in `make test` (what needs CUDA by
nature is reported as skipped), `--device cuda --dry-run` as the smoke test a lease can afford first.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time

from benchmarks.gpu import card, correctness, fp8, goals, kernels, memory_check, report, training, tuning
from benchmarks.gpu.context import Options, say
from benchmarks.gpu.runner import GRACE, Section, cuda_visible, run_sections

PROG = "benchmarks/gpu_check.py"
TOTAL = {"full": 480, "quick": 240, "dry-run": 360}  # seconds the default sections may take, graces included
LIMIT = 600  # seconds a run of sections given --budgets may take: a lease's limit for one command
SECTIONS = (  # budgets in seconds; with runner.GRACE each, the default sections' fit TOTAL (tests/test_gpu_check.py)
    Section("card", card.run, {"full": 15, "quick": 10, "dry-run": 10}),
    Section("correctness", correctness.run, {"full": 150, "quick": 45, "dry-run": 45}),  # 7 torchrun jobs: ~2 min
    Section("kernels", kernels.run, {"full": 55, "quick": 25, "dry-run": 20}),
    # a developer's sweep of launch settings, not a figure a user needs: run when --only names it (and dry)
    Section("tuning", tuning.run, {"full": 20, "quick": 10, "dry-run": 5}, default=False),
    Section("training", training.run, {"full": 130, "quick": 70, "dry-run": 120}),
    Section("memory", memory_check.run, {"full": 15, "quick": 10, "dry-run": 45}),  # CPU: 2 spawned ranks
    Section("fp8", fp8.run, {"full": 55, "quick": 20, "dry-run": 35}),
)


def parse(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer cases and steps: within 4 minutes")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="folder for the JSON and table")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes: exercises every code path quickly")
    p.add_argument("--only", metavar="NAMES", help="comma-separated sections to run (the others are "
                   f"left out): {', '.join(s.name for s in SECTIONS)}")
    p.add_argument("--budgets", metavar="NAME=S,...", help="seconds for the sections named, in place of their "
                   "defaults (a rerun of a few sections with --only can give them what the others left)")
    p.add_argument("--models", metavar="NAMES", default=",".join(training.FAMILIES),
                   help=f"the training section's models, in this order (default {','.join(training.FAMILIES)}): "
                   "gpt2 alone reruns the rows a budget left out")
    p.add_argument("--table", metavar="FILE.json",
                   help="print docs/evidence.md's 'Measured on GPU' table of a results file")
    return p.parse_args(argv)


def problem(args):
    """One line saying what is wrong with the request, or None."""
    if args.device == "cpu" and not args.dry_run:
        return "--device cpu: the full sizes need a GPU; add --dry-run for the tiny CPU run"
    unknown = sorted(set(chosen(args)) - {s.name for s in SECTIONS}) if args.only else []
    if unknown:
        return f"--only: no section named {', '.join(unknown)}; the sections are {', '.join(s.name for s in SECTIONS)}"
    names = models(args)
    if not names or set(names) - set(training.FAMILIES):
        return (f"--models {args.models}: choose from {', '.join(training.FAMILIES)} (comma-separated, e.g. "
                f"--models gpt2)")
    mode = options(args).mode
    try:
        need = sum(s.budget[mode] + GRACE for s in planned(args, mode))
    except ValueError as exc:
        return f"--budgets {args.budgets}: {exc}; write e.g. kernels=120,tuning=40"
    if need > ceiling(args, mode):  # the runner would starve the first sections to keep the later ones' budgets
        return (f"--budgets {args.budgets}: the sections chosen need {need:.0f} s with {GRACE:.0f} s of grace each, "
                f"over the {ceiling(args, mode)} s a {mode} run may take; give them less")
    if args.device == "cuda" and not cuda_visible():
        return "--device cuda: no CUDA device is visible; use --device cpu --dry-run"
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        return f"--out {args.out}: cannot create it ({exc.strerror})"
    if not os.access(args.out, os.W_OK):
        return f"--out {args.out}: not writable"
    return None


def ceiling(args, mode: str) -> float:
    """The seconds this run may take: TOTAL's for the sections' own budgets, LIMIT where --budgets gives others."""
    return LIMIT if args.budgets and mode != "dry-run" else TOTAL[mode]


def chosen(args) -> list:
    """The section names --only asks for, else the default ones (a dry run: every section, so none can rot)."""
    if not args.only:
        return [s.name for s in SECTIONS if s.default or args.dry_run]
    return [n.strip() for n in args.only.split(",") if n.strip()]


def models(args) -> tuple:
    """The training section's models --models names, in its order."""
    return tuple(m.strip() for m in args.models.split(",") if m.strip())


def options(args) -> Options:
    """The run's options, its clock started now."""
    return Options(args.device, args.quick, args.dry_run, args.out, time.time(), models(args))


def planned(args, mode: str) -> list:
    """The sections --only chooses, in their order, with the seconds --budgets gives them in `mode`."""
    given = budgets(args)
    return [dataclasses.replace(s, budget={**s.budget, mode: given[s.name]}) if s.name in given else s
            for s in SECTIONS if s.name in chosen(args)]


def budgets(args) -> dict:
    """{section name: seconds} from --budgets; ValueError naming what is wrong."""
    given = {}
    for item in filter(None, (args.budgets or "").split(",")):
        name, _, seconds = item.partition("=")
        if name.strip() not in {s.name for s in SECTIONS}:
            raise ValueError(f"no section named {name.strip()}")
        try:
            given[name.strip()] = float(seconds)
        except ValueError:
            raise ValueError(f"{item}: seconds must be a number") from None
        if given[name.strip()] <= 0:
            raise ValueError(f"{item}: seconds must be positive")
    return given


def assemble(opts: Options, sections: dict) -> dict:
    name = sections.get("card", {}).get("figures", {}).get("name", {}).get("value") or "unknown card"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    suffix = "" if opts.mode == "full" else f"-{opts.mode}"
    result = {"schema": 1, "card": name, "device": opts.device, "mode": opts.mode, "date": date,
              "save_as": f"benchmarks/results/gpu-{slug}-{date}{suffix}.json", "command": " ".join(sys.argv),
              "total_s": round(time.time() - opts.started, 1), "sections": sections}
    try:
        result["goals"] = goals.evaluate(sections, opts.mode)
    except Exception as exc:  # noqa: BLE001 - figures the goals did not expect must not lose the figures
        result["goals"] = [goals.goal("goals", None, "", None, f"evaluation failed: {type(exc).__name__}: {exc}")]
    return result


def save(opts: Options, sections: dict, result: dict | None = None) -> None:
    """Write gpu_check.json: the finished result, or (result None) the sections gathered so far."""
    result = result or dict(assemble(opts, sections), complete=False)
    tmp = os.path.join(opts.out, "gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(opts.out, "gpu_check.json"))


def print_table(path: str) -> int:
    try:
        with open(path) as f:
            result = json.load(f)
        text = report.readme_table(result)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{PROG}: --table {path}: not a gpu-check results file ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.table:
        return print_table(args.table)
    why = problem(args)
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    # before any CUDA context (the sections' forked children make theirs): three 1.3B loops resident leave little
    # room, and the H100 run's out-of-memory had 3 GiB reserved but unallocated
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    opts = options(args)
    sections = planned(args, opts.mode)
    total = sum(s.budget[opts.mode] + GRACE for s in sections)
    say(opts, f"gpu-check {opts.mode} on {opts.device}, within {total:.0f} s; output in {opts.out}")
    # after each section the figures so far are saved: a run killed from outside (a lease's limit) keeps them
    result = assemble(opts, run_sections(sections, opts, total, after=lambda done: save(opts, done)))
    save(opts, result["sections"], result)  # first: the figures are safe whatever the rendering does
    try:
        text = report.markdown(result)
    except Exception as exc:  # noqa: BLE001 - say so in the tail, where the lease shows it
        text = f"the table could not be rendered ({type(exc).__name__}: {exc}); the figures are in gpu_check.json\n"
    with open(os.path.join(opts.out, "gpu_check.md"), "w") as f:
        f.write(text)
    say(opts, f"wrote {opts.out}/gpu_check.json and gpu_check.md; commit the JSON as {result['save_as']}")
    print(text, end="", flush=True)
    bad = [n for n, r in result["sections"].items() if r["status"] in ("failed", "timeout", "crashed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

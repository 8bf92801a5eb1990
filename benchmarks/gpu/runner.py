"""Runs each section in its own forked process under a time budget, and gathers what each one recorded.

Why a process per section: a CUDA fault (an illegal address in an untested kernel) poisons the whole process,
and a hang cannot be interrupted from inside it; in a child, either costs that section only. Fork rather than
spawn: the children inherit the imported torch, engine and transformers, which would otherwise be imported
again per section. The parent never touches CUDA itself (a CUDA context does not survive fork), so whether a
GPU is there is asked of a forked probe.

A section stops starting new work at its deadline (context.Record.has_time); the runner kills it GRACE seconds
after that, then keeps what its record file holds. Status: ok, partial (something skipped for time), failed
(an exception, text kept), timeout (killed), crashed (died without a Python exception, exit code kept).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from benchmarks.gpu.context import OUT_OF_TIME, Options, Record, say

GRACE = 10.0       # seconds past a section's deadline before it is killed: one step or one case finishing
MIN_BUDGET = 5.0   # a section given less is not started


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable            # run(opts, record, earlier): earlier = the sections before, as gathered here
    budget: dict             # mode ("full", "quick", "dry-run") -> seconds
    default: bool = True     # run when no section is named (--only); a dry run runs every section


def cuda_visible() -> bool:
    """Whether torch sees a GPU, asked in a forked child so that this process never creates a CUDA context."""
    def probe():
        import torch
        os._exit(0 if torch.cuda.is_available() else 3)
    child = multiprocessing.get_context("fork").Process(target=probe)
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
    return child.exitcode == 0


def run_sections(sections, opts: Options, total_s: float, after=None) -> dict:
    """{name: result} for every section, in order; each sees the results of those before it. A section's
    budget shrinks when earlier ones overran, so that the whole run ends within `total_s` (each later section
    keeping its own budget); one left with under MIN_BUDGET seconds is recorded as skipped for time.
    `after(results)`, when given, is called after each section (the caller saves what is gathered so far)."""
    results = {}
    end = opts.started + total_s
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for i, section in enumerate(sections):
            later = sum(s.budget[opts.mode] + GRACE for s in sections[i + 1:])
            budget = min(section.budget[opts.mode], end - time.time() - later - GRACE)
            if budget < MIN_BUDGET:
                results[section.name] = {"status": "skipped", "seconds": 0.0, "budget_s": round(budget, 1),
                                         "figures": {}, "tables": {}, "notes": [],
                                         "skipped": {section.name: f"{OUT_OF_TIME}: earlier sections overran"}}
                continue
            results[section.name] = run_one(section, opts, dict(results), os.path.join(tmp, f"{section.name}.json"),
                                            budget)
            if after is not None:
                after(dict(results))
    return results


def run_one(section: Section, opts: Options, earlier: dict, path: str, budget: float) -> dict:
    """Fork, wait for the deadline plus GRACE, end the section's whole process group, read its record."""
    say(opts, f"section {section.name}: starting, budget {budget:.0f} s")
    start = time.time()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(section, opts, earlier, path,
                                                                             start + budget))
    child.start()
    child.join(budget + GRACE)
    killed = child.is_alive()
    if killed:
        _end_group(child.pid, signal.SIGTERM)
        child.join(5)
    _end_group(child.pid, signal.SIGKILL)  # also what it started and left behind (pytest, workers, compilers)
    child.join()
    result = _read(path)
    result.update(seconds=round(time.time() - start, 1), budget_s=round(budget, 1))
    result["status"] = _status(result, killed, child.exitcode, budget)
    say(opts, f"section {section.name}: {result['status']} in {result['seconds']:.0f} s"
        + (f": {result['error'].splitlines()[-1]}" if result.get("error") else ""))
    return result


def _end_group(pid: int, sig) -> None:
    """Signal the section's process group: the section and every process it started."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _child(section: Section, opts: Options, earlier: dict, path: str, deadline: float) -> None:
    os.setpgid(0, 0)  # its own process group, so that ending it ends its subprocesses too (not a new session)
    record = Record(section.name, path, opts, deadline)
    try:
        section.run(opts, record, earlier)
    except BaseException as exc:  # noqa: BLE001 - whatever happened is the finding; the runner reports it
        record.fail("".join(traceback.format_exception(exc))[-4000:])
        os._exit(1)
    os._exit(0)  # no atexit or finalizers of the inherited parent state in the child


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        return {"figures": {}, "tables": {}, "skipped": {}, "notes": [], "error": f"no record: {exc}"}


def _status(result: dict, killed: bool, exitcode, budget: float) -> str:
    if killed:
        result.setdefault("error", f"killed: still running {GRACE:.0f} s past its {budget:.0f} s budget")
        return "timeout"
    if result.get("error"):
        return "failed"
    if exitcode != 0:
        result["error"] = f"the section's process died with exit code {exitcode}"
        return "crashed"
    if any(OUT_OF_TIME in reason for reason in result["skipped"].values()):
        return "partial"
    return "ok"

"""Section 2, correctness on the device: the fp32 step equality, then `pytest -m gpu` as a subprocess.

The tests marked gpu check every Triton kernel against its reference in fp32 and bf16 at real sizes, and the
planner's peak against the allocator. They run in their own pytest process (their CUDA context is theirs) with
--continue-on-collection-errors: a test module that cannot import on the GPU machine (a package only the dev
machine has) is counted as an error, not a reason to run nothing. Results come from pytest's JUnit XML. Off
CUDA the tests are only collected: their count shows the marker still selects them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from benchmarks.gpu import fp32_step
from benchmarks.gpu.context import NEEDS_CUDA, OUT_OF_TIME
from benchmarks.gpu.models import ROOT


def run(opts, record, earlier) -> None:
    cases = [(f, False) for f in ("llama", "gpt2")] + ([(f, True) for f in ("llama", "gpt2")] if opts.cuda else [])
    for family, reference_kernels in cases:
        r = fp32_step.compare(family, opts.device, reference_kernels)
        record.row("fp32_step", r, f"fp32 step {family} {opts.device} ({r['kernels']} kernels) vs cpu: loss "
                                   f"{r['loss_rel_diff']:.1e}, grad norm {r['grad_norm_rel_diff']:.1e}, weights "
                                   f"{r['weights_rel_diff']:.1e} (anchor <= {r['tolerance']:.0e}): "
                                   f"{'equal' if r['equal'] else 'DIFFERENT'}; worst grads {r['worst_grads']}, "
                                   f"worst weights {r['worst_weights']}")
    pytest_gpu(opts, record)


MULTI_RANK = "test_distributed_backend.py"  # its torchrun jobs take seconds each: run after the kernel checks


def pytest_gpu(opts, record) -> None:
    """Run (on CUDA, full or quick) or only collect (a dry run, or no CUDA) the gpu-marked tests within what is
    left of the budget: the kernel and planner checks first, then the multi-rank jobs, each group in its own
    pytest process so that running out of time in the second keeps the first's results."""
    reserve = 5.0
    if not record.has_time("pytest -m gpu", 20.0 + reserve):
        return
    files = gpu_test_files()
    if not (opts.cuda and not opts.dry_run):
        proc = _pytest(files + ["--collect-only"], record.left() - reserve)
        if isinstance(proc, subprocess.TimeoutExpired):  # a loaded machine: said, not a failure of the section
            record.skip("pytest -m gpu (collect)", f"{OUT_OF_TIME}: killed after {proc.timeout:.0f} s")
            return
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        record.figure("pytest_gpu_collected", int(found.group(1)) if found else 0, "tests", note="collected only")
        record.skip("pytest -m gpu (run)", "skipped: dry run (real sizes)" if opts.cuda else NEEDS_CUDA)
        return
    # spread over pytest-xdist workers (where installed) that share the one card: the kernel cases spend most of
    # their time compiling Triton kernels on the host (H100, serial: past 145 s; H200, 8 workers: 63 s), the
    # six torchrun jobs mostly starting processes (H200, serial: 132 s, two of them 37 s each); torchrun
    # --standalone and the harness's ranks each take a free port
    groups = (("kernels and planner", [f for f in files if not f.endswith(MULTI_RANK)], KERNEL_WORKERS),
              ("gloo ranks on one GPU", [f for f in files if f.endswith(MULTI_RANK)], JOB_WORKERS))
    failed = []
    for name, group, n in groups:
        if not group or not record.has_time(f"pytest -m gpu ({name})", 10.0 + reserve):
            continue
        summary = _run_group(name, group + workers(n), record.left() - reserve, record)
        failed += summary.get("failing", [])
    record.figure("pytest_gpu_failed", len(failed), "tests", "0", "; ".join(failed[:10]))


def workers(n: int) -> list:
    """pytest-xdist's arguments for n processes, or none where xdist is not installed."""
    import importlib.util
    return ["-n", str(n)] if importlib.util.find_spec("xdist") else []


KERNEL_WORKERS, JOB_WORKERS = 8, 3  # the lease machines have 16 cores; a job group runs 2 ranks a job


def _pytest(args: list, timeout: float, junit: str | None = None):
    """pytest -m gpu on `args` in a subprocess: its CompletedProcess, or the TimeoutExpired."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", *args,
           "--continue-on-collection-errors"] + ([f"--junitxml={junit}"] if junit else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return exc


def _run_group(name: str, files: list, timeout: float, record) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "gpu.xml")
        proc = _pytest(files, timeout, junit)
        if isinstance(proc, subprocess.TimeoutExpired):  # what finished, from pytest's -v lines
            out = proc.stdout.decode(errors="replace") if isinstance(proc.stdout, bytes) else (proc.stdout or "")
            summary = verbose_summary(out)
            record.skip(f"pytest -m gpu ({name})", f"{OUT_OF_TIME}: killed after {proc.timeout:.0f} s, "
                                                   f"{sum(summary[k] for k in ('passed', 'failed', 'errors'))} done")
        elif not os.path.exists(junit):  # the section fails with pytest's own words; earlier rows are kept
            raise RuntimeError(f"pytest -m gpu ({name}) wrote no report (exit {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr)[-1500:]}")
        else:
            summary = {**junit_summary(junit), "returncode": proc.returncode}
    summary["group"] = name
    record.row("pytest_gpu", summary, f"pytest -m gpu ({name}): {summary.get('passed', 0)} passed, "
                                      f"{summary.get('failed', 0)} failed, {summary.get('errors', 0)} errors, "
                                      f"{summary.get('skipped', 0)} skipped (anchor: all pass)")
    for case, why in summary.get("why", {}).items():
        record.note(f"{case}: {why}")
    return summary


VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", re.M)
VERBOSE_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", re.M)


def verbose_summary(out: str) -> dict:
    """Counts and failing ids from pytest -v output (a run killed before its JUnit report), with or without
    xdist's workers."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}
    failing = []
    found = VERBOSE.findall(out) + [(case, outcome) for outcome, case in VERBOSE_XDIST.findall(out)]
    for case, outcome in found:
        counts[key[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            failing.append(case)
    return {**counts, "failing": failing, "why": {}}


GPU_MARKS = re.compile(r"mark\.gpu\b|\bgpu_test\b")  # pytest.mark.gpu, or test_kernels' gpu_test decorator


def gpu_test_files() -> list:
    """The test modules that mark anything gpu (by GPU_MARKS): collecting the others (transformers, megatron-core
    and all) only to deselect them costs seconds of the budget."""
    folder = os.path.join(ROOT, "tests")
    names = sorted(n for n in os.listdir(folder) if n.startswith("test_") and n.endswith(".py"))
    return [os.path.join("tests", n) for n in names if GPU_MARKS.search(open(os.path.join(folder, n)).read())]


def junit_summary(path: str) -> dict:
    """Counts and the ids of failing or erroring cases from a pytest JUnit XML file."""
    cases = list(ET.parse(path).getroot().iter("testcase"))
    failing, why, counts = [], {}, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in cases:
        kinds = {child.tag: child for child in case}
        case_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = kinds.get("failure", kinds.get("error"))  # not `or`: an Element without children is false
        if bad is not None:  # the message and the traceback's end: what the fix on CPU starts from
            counts["failed" if "failure" in kinds else "errors"] += 1
            failing.append(case_id)
            why[case_id] = (bad.get("message", "")[:300] + " | " + (bad.text or "")[-900:]).strip()
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failing": failing, "why": why}

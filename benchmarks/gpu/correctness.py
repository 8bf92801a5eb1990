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
    for family in ("llama", "gpt2"):
        r = fp32_step.compare(family, opts.device)
        record.row("fp32_step", r, f"fp32 step {family} {opts.device} vs cpu: loss {r['loss_rel_diff']:.1e}, "
                                   f"grad norm {r['grad_norm_rel_diff']:.1e}, weights {r['weights_rel_diff']:.1e} "
                                   f"(anchor <= {r['tolerance']:.0e}): {'equal' if r['equal'] else 'DIFFERENT'}")
    pytest_gpu(opts, record)


def pytest_gpu(opts, record) -> None:
    """Run (on CUDA, full or quick) or only collect (a dry run, or no CUDA) the gpu-marked tests within what is
    left of the budget."""
    reserve = 5.0
    if not record.has_time("pytest -m gpu", 20.0 + reserve):
        return
    run = opts.cuda and not opts.dry_run
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "gpu.xml")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", *gpu_test_files(), "--continue-on-collection-errors",
               f"--junitxml={junit}"] + ([] if run else ["--collect-only"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=record.left() - reserve)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-600:].decode(errors="replace")  # bytes even with text=True
            record.skip("pytest -m gpu", f"{OUT_OF_TIME}: killed after {exc.timeout:.0f} s; output so far: {tail}")
            return
        if not run:
            found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
            record.figure("pytest_gpu_collected", int(found.group(1)) if found else 0, "tests", note="collected only")
            record.skip("pytest -m gpu (run)", "skipped: dry run (real sizes)" if opts.cuda else NEEDS_CUDA)
            return
        if not os.path.exists(junit):  # the section fails with pytest's own words; the fp32 rows are kept
            raise RuntimeError(f"pytest -m gpu wrote no report (exit {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr)[-1500:]}")
        summary = junit_summary(junit)
    summary["returncode"] = proc.returncode
    record.row("pytest_gpu", summary, f"pytest -m gpu: {summary.get('passed', 0)} passed, {summary.get('failed', 0)} "
                                      f"failed, {summary.get('errors', 0)} errors, {summary.get('skipped', 0)} skipped "
                                      f"(anchor: all pass)")
    record.figure("pytest_gpu_failed", summary.get("failed", 0) + summary.get("errors", 0), "tests",
                  "0", "; ".join(summary.get("failing", [])[:10]))


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
        bad = kinds.get("failure") or kinds.get("error")
        if bad is not None:  # the message and the traceback's end: what the fix on CPU starts from
            counts["failed" if "failure" in kinds else "errors"] += 1
            failing.append(case_id)
            why[case_id] = (bad.get("message", "")[:300] + " | " + (bad.text or "")[-900:]).strip()
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failing": failing, "why": why}

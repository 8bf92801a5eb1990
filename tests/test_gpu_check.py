"""benchmarks/gpu_check.py cannot rot between GPU leases: its CPU dry run goes through every section at tiny
sizes (~60 s on 2 cores), the JSON it writes has the shape the README table and the goals read, the table is
the last thing printed (a lease returns only the output's tail), and one section failing, hanging or dying
costs that section only.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ["card", "correctness", "kernels", "training", "memory"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--dry-run", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_dry_run_reports_every_section_and_prints_the_table_last(dry_run):
    proc, out, result = dry_run
    assert list(result["sections"]) == SECTIONS
    for name, section in result["sections"].items():
        # ok, or partial with the reason each skipped item was skipped (a loaded machine may run out of time)
        assert section["status"] in ("ok", "partial"), (name, section.get("error"))
        assert all(isinstance(why, str) and why for why in section["skipped"].values())
    assert result["mode"] == "dry-run" and result["save_as"].startswith("benchmarks/results/gpu-")
    assert proc.stdout.rstrip().endswith((out / "gpu_check.md").read_text().rstrip())
    assert "### goals" in proc.stdout.rstrip().splitlines()[-len(result["goals"]) - 3]


@pytest.mark.slow
def test_dry_run_figures(dry_run):
    _, _, result = dry_run
    s = result["sections"]
    assert s["card"]["figures"]["matmul_tflops"]["value"] > 0 and s["card"]["figures"]["copy_tbps"]["value"] > 0
    steps = s["correctness"]["tables"]["fp32_step"]
    assert {r["family"] for r in steps} == {"llama", "gpt2"} and all(r["equal"] for r in steps)
    kernels = s["kernels"]["tables"]["kernels"]
    assert all(r["rate"] > 0 for r in kernels if r["impl"] == "eager") and any(r["impl"] == "eager" for r in kernels)
    assert any("needs CUDA" in why for why in s["kernels"]["skipped"].values())
    eager = [r for r in s["training"]["tables"]["training"] if r["mode"] == "eager" and r["family"] == "llama"]
    assert {r["loop"] for r in eager} == {"engine", "plain", "transformers"}
    assert all(r["tokens_per_s"] > 0 and r["loss_max_diff_vs_plain"] < 1e-4 for r in eager)
    assert all(r["measured_over_expected"] <= 1.05 for r in s["memory"]["tables"]["saved_bytes"])
    assert result["goals"] and {g["verdict"] for g in result["goals"]} == {"not measured"}


@pytest.mark.slow
def test_table_renders_the_readme_rows_with_the_card_on_each(dry_run, capsys):
    from benchmarks import gpu_check
    _, out, result = dry_run
    assert gpu_check.main(["--table", str(out / "gpu_check.json")]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert rows and all(row.startswith(f"| {result['card']} | {result['date']} |") for row in rows)


def _ok(opts, record, earlier):
    record.figure("first", 1.0, "u", "anchor")


def _boom(opts, record, earlier):
    record.figure("before", 2.0, "u")
    raise RuntimeError("planted failure")


def _hang(opts, record, earlier):
    record.figure("before", 3.0, "u")
    time.sleep(60)


def _die(opts, record, earlier):
    os._exit(7)


def _last(opts, record, earlier):
    record.figure("seen", len(earlier), "sections")


def test_a_failing_hanging_or_dying_section_costs_only_itself(tmp_path, monkeypatch):
    from benchmarks.gpu import runner
    from benchmarks.gpu.context import Options
    monkeypatch.setattr(runner, "GRACE", 1.0)
    budget = {"dry-run": runner.MIN_BUDGET}
    sections = [runner.Section(n, f, budget) for n, f in (("ok", _ok), ("boom", _boom), ("hang", _hang),
                                                          ("die", _die), ("last", _last))]
    results = runner.run_sections(sections, Options("cpu", False, True, str(tmp_path), time.time()), 60)
    assert [results[n]["status"] for n in results] == ["ok", "failed", "timeout", "crashed", "ok"]
    assert "RuntimeError: planted failure" in results["boom"]["error"]
    assert results["boom"]["figures"]["before"]["value"] == 2.0  # what it measured before failing is kept
    assert results["hang"]["figures"]["before"]["value"] == 3.0
    assert "exit code 7" in results["die"]["error"]
    assert results["last"]["figures"]["seen"]["value"] == 4


def test_bad_requests_are_one_line_and_exit_2(tmp_path, capsys):
    from benchmarks import gpu_check
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert gpu_check.main(["--table", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "other.json").write_text("{}")
    assert gpu_check.main(["--table", str(tmp_path / "other.json")]) == 2
    if not torch.cuda.is_available():
        assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == (4 if not torch.cuda.is_available() else 3)
    assert all(line.startswith("benchmarks/gpu_check.py: ") for line in err)

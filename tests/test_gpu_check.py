"""benchmarks/gpu_check.py cannot rot between GPU leases: its CPU dry run goes through every section at tiny
sizes (~60 s on 2 cores), the JSON it writes has the shape the README table and the goals read, the table is
the last thing printed (a lease returns only the output's tail), and one section failing, hanging or dying
costs that section only.
"""
import contextlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ["card", "correctness", "kernels", "tuning", "training", "memory", "fp8"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--dry-run", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    result = json.loads((out / "gpu_check.json").read_text())
    bad = {n: (r["status"], r["seconds"], r["budget_s"], (r.get("error") or "")[-1500:])
           for n, r in result["sections"].items() if r["status"] not in ("ok", "partial", "skipped")}
    assert proc.returncode == 0, f"sections not ok: {bad}; stderr: {proc.stderr[-1500:]}"
    return proc, out, result


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
    # every matrix product of each profiled step by shapes: the compiled engine and plain steps run the same ones
    gemms = s["training"]["tables"]["gemms"]
    calls = {step: sum(r["calls"] for r in gemms if (r["family"], r["phase"], r["op"]) == ("llama", step, "aten::mm"))
             for step in ("eager", "compile", "compile (plain)")}
    assert calls["eager"] > 0 and len(set(calls.values())) == 1, calls
    assert all(r["shapes"].startswith("[[") for r in gemms)
    # ... and each of those steps' products carry the model's FLOPs, no more, no fewer (the H200's compiled plain
    # step of 2026-11-27 ran fewer: its products' time would have meant 1.15x the card's matmul rate)
    totals = s["training"]["tables"]["product_totals"]
    assert len(totals) == 6 and all(r["tflop"] == pytest.approx(r["model_tflop"], rel=1e-5) for r in totals), totals
    # every loop's compiled gradients are its eager ones (on the CPU dynamo captures only: exactly)
    grads = s["training"]["tables"]["compiled_grads"]
    assert {(r["family"], r["loop"]) for r in grads} == {(f, n) for f in ("llama", "gpt2")
                                                         for n in ("engine", "plain", "transformers")}
    assert all(r["match"] and r["params"] > 0 and r["worst_rel_diff"] == 0.0 for r in grads), grads
    compiled = [r for r in s["training"]["tables"]["training"] if r["mode"] == "compile"]
    assert compiled and all(r["grads_match_eager"] is True for r in compiled)
    assert result["goals"] and {g["verdict"] for g in result["goals"]} == {"not measured"}
    steps = {r["precision"]: r for r in s["fp8"]["tables"]["fp8_step"]}
    delayed = {name: r["final_loss"] for name, r in steps.items() if "delayed" in name and "output" not in name}
    assert len(delayed) == 2 and len(set(delayed.values())) == 1, delayed  # the one-pass codes change no number
    # delayed with the output layer in FP8 too (--fp8-output-layer): another run, with the planner's prediction
    # (its pricing: tests/test_fp8_output_layer.py)
    head = steps["fp8 hybrid delayed, output layer"]
    assert head["final_loss"] != steps["fp8 hybrid delayed"]["final_loss"] and head["planner_speedup"] > 0
    # each run's memory beside the planner's (no peak without CUDA): the output layer's held codes and its quantized
    # logits' gradient on top of delayed's, the held weights on top of bf16's
    assert all(r["peak_gib"] is None and r["planner_gib"] > 0 for r in steps.values())
    assert head["planner_gib"] > steps["fp8 hybrid delayed"]["planner_gib"] > steps["fp32 (CPU)"]["planner_gib"]
    codes = s["fp8"]["tables"]["fp8_codes"]
    assert [r["pass"] for r in codes] == ["cast", "swiglu forward", "swiglu backward"]
    assert all(r[f"{k}_ms"] > 0 for r in codes for k in ("apart", "delayed", "tensorwise"))


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


@pytest.mark.slow  # three forked sections, one of them hanging to its budget: ~6 s
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


# --- what only a GPU run produces, rendered and judged here (the lease must not be the first to try) -------

def _fig(value, unit="", anchor=""):
    return {"value": value, "unit": unit, "anchor": anchor, "note": ""}


def _section(figures=None, tables=None):
    return {"status": "ok", "seconds": 1.0, "budget_s": 10, "skipped": {}, "notes": [], "figures": figures or {},
            "tables": tables or {}}


def _kernel(kernel, impl, rate, unit="TB/s"):
    return {"kernel": kernel, "impl": impl, "rate": rate, "unit": unit, "fwd_ms": 1.0, "bwd_ms": 2.0, "anchor": "a"}


def _train(family, loop, mode, step_s, peak=None, planner=30.0):
    return {"model": family, "family": family, "loop": loop, "mode": mode, "micro_batch": 4, "step_s": step_s,
            "tokens_per_s": 16384 / step_s, "mfu_989": 0.135 / step_s, "mfu_measured": 0.17 / step_s,
            "mfu_anchor": "a", "peak_gib": peak, "planner_gib": planner, "warm_up_s": 1.0, "error": None,
            "planner_over_measured": planner / peak if peak else None, "loss_max_diff_vs_plain": 0.01}


def gpu_shaped_sections():
    card = _section({"name": _fig("NVIDIA H100 80GB HBM3"), "matmul_tflops": _fig(790.0, "TFLOP/s", "~790"),
                     "copy_tbps": _fig(3.0, "TB/s", "~3.0")})
    step = {"family": "llama", "device": "cuda", "loss_rel_diff": 1e-7, "grad_norm_rel_diff": 2e-7,
            "weights_rel_diff": 1e-8, "update_rel_diff": 1e-4, "equal": True, "tolerance": 1e-5}
    tests = {"passed": 29, "failed": 1, "errors": 0, "skipped": 0, "failing": ["tests.test_kernels::test_x"]}
    kernels = [_kernel("rms_norm", "triton", 2.7), _kernel("rms_norm", "eager", 1.5), _kernel("swiglu", "triton", 2.0),
               _kernel("cross_entropy", "triton-inplace", 1.6), _kernel("attention_d128_s4096", "triton", 250.0,
                                                                      "TFLOP/s"),
               _kernel("attention_d128_s4096", "sdpa-flash", 300.0, "TFLOP/s"),
               {"kernel": "attention_d128_s4096", "impl": "sdpa-cudnn", "error": "RuntimeError: x", "anchor": "a"}]
    training = [_train("llama", "engine", "eager", 0.30, peak=31.0), _train("llama", "plain", "eager", 0.36),
                _train("llama", "transformers", "compile", 0.34), _train("gpt2", "engine", "eager", 0.05, peak=8.0,
                                                                         planner=12.0)]
    return {"card": card, "correctness": _section(tables={"fp32_step": [step], "pytest_gpu": [tests]}),
            "kernels": _section(tables={"kernels": kernels}), "training": _section(tables={"training": training}),
            "memory": _section()}


def test_goals_judge_gpu_figures():
    from benchmarks.gpu import goals
    verdicts = {g["goal"]: g["verdict"] for g in goals.evaluate(gpu_shaped_sections(), "full")}
    assert verdicts["engine 1.3B step vs best baseline"] == "met"  # 0.34 / 0.30 = 1.13x
    assert verdicts["engine 1.3B MFU"] == "met"                      # 45%
    assert verdicts["rms_norm fwd+bwd vs copy"] == "met" and verdicts["swiglu fwd+bwd vs copy"] == "missed"
    assert verdicts["layer_norm fwd+bwd vs copy"] == "not measured"
    assert verdicts["cross-entropy V=128k fwd+bwd"] == "met"
    assert verdicts["attention_d128_s4096 Triton kernel fwd+bwd vs sdpa-flash"] == "missed"
    assert verdicts["attention_d128_s4096 auto (sdpa-cudnn) fwd+bwd vs sdpa-flash"] == "not measured"  # its row failed
    assert verdicts["planner memory, engine llama eager"] == "met"   # 30 / 31
    assert verdicts["planner memory, engine gpt2 eager"] == "missed"  # 12 / 8


def test_a_compiled_row_whose_gradients_are_not_its_eager_ones_is_left_out_of_the_speed_goal():
    from benchmarks.gpu import goals
    sections = gpu_shaped_sections()
    rows = sections["training"]["tables"]["training"]
    rows.append({**_train("llama", "plain", "compile", 0.20), "grads_match_eager": False})  # 1.5x the engine, not so
    verdict = next(g for g in goals.evaluate(sections, "full") if g["goal"] == "engine 1.3B step vs best baseline")
    assert verdict["verdict"] == "met" and verdict["measured"].startswith("1.13x (transformers compile)")
    assert "plain compile" in verdict["note"]
    rows[-1]["grads_match_eager"] = True
    verdict = next(g for g in goals.evaluate(sections, "full") if g["goal"] == "engine 1.3B step vs best baseline")
    assert verdict["verdict"] == "missed" and verdict["measured"].startswith("0.67x (plain compile)")
    # the engine's own compiled row counts (a torch.compile row); the best plain or transformers row is said beside
    rows[-1]["grads_match_eager"] = False
    rows.append({**_train("llama", "engine", "compile", 0.29), "grads_match_eager": True})
    verdict = next(g for g in goals.evaluate(sections, "full") if g["goal"] == "engine 1.3B step vs best baseline")
    assert verdict["verdict"] == "missed" and verdict["measured"].startswith("0.97x (engine compile)")
    assert "1.13x the best plain or transformers row (transformers compile)" in verdict["note"]


class _Loop:
    """A loop as grad_check sees one: its model, its mean loss on a batch and its autocast dtype."""
    autocast = None

    def __init__(self, forward):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.model.extra = torch.nn.Parameter(torch.randn(3))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.model.register_parameter("frozen", self.frozen)
        self.model.forward = forward.__get__(self.model)

    def loss(self, batch):
        return self.model(batch["tokens"]).square().mean()


def _drops_extra_when_compiled(self, x):
    extra = self.extra.detach() if torch.compiler.is_compiling() else self.extra
    return torch.nn.functional.linear(x, self.weight, self.bias) * extra + self.frozen


def _scales_when_compiled(self, x):
    weight = self.weight * 1.1 if torch.compiler.is_compiling() else self.weight
    return torch.nn.functional.linear(x, weight, self.bias) * self.extra


def test_grad_check_finds_a_gradient_a_compiled_step_drops_or_changes():
    """What the training section asks of each compiled loop, shown failing: a compiled graph that loses a
    parameter's gradient, and one that computes another one (dynamo traces the `is_compiling` branch; the eager
    side runs under set_stance("force_eager"))."""
    from benchmarks.gpu import grad_check
    batch = {"tokens": torch.randn(5, 4)}
    for forward, missing, worst in ((_drops_extra_when_compiled, ["extra"], None), (_scales_when_compiled, [], "bias")):
        loop = _Loop(forward)
        torch._dynamo.reset()
        loop.model.compile(backend="eager")
        got = grad_check.compiled_vs_eager(loop, batch)
        assert got["params"] == 3 and got["missing_first"] == missing and not got["match"], got
        if worst:  # the 1.1x weight changes every gradient; the bias's most (its loss term is the one scaled)
            assert got["worst_rel_diff"] > grad_check.TOLERANCE and got["worst_param"] in ("weight", "bias", "extra")
    honest = _Loop(lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias) * self.extra)
    torch._dynamo.reset()
    honest.model.compile(backend="eager")
    assert grad_check.compiled_vs_eager(honest, batch)["match"]


def test_product_flops_from_the_profilers_input_shapes():
    from benchmarks.gpu.bench import product_tflop
    mm = [[16384, 2048], [2048, 8192], [16384, 8192]]  # a compiled graph's mm.out: its output's shape last
    assert product_tflop("aten::mm", mm, 2) == 2 * 2 * 16384 * 2048 * 8192 / 1e12
    assert product_tflop("aten::addmm", [[10], [4, 5], [5, 10]], 3) == 3 * 2 * 4 * 5 * 10 / 1e12
    assert product_tflop("aten::bmm", [[3, 4, 5], [3, 5, 6]], 1) == 2 * 3 * 4 * 5 * 6 / 1e12
    assert product_tflop("aten::matmul", [[4, 5], [5, 6]], 1) is None  # its aten::mm is listed too


def test_gpu_figures_render_as_the_printed_and_the_readme_table():
    from benchmarks.gpu import goals, report
    sections = gpu_shaped_sections()
    result = {"card": "NVIDIA H100 80GB HBM3", "mode": "full", "date": "2026-01-01", "total_s": 400.0,
              "save_as": "benchmarks/results/gpu-h100-80gb-hbm3-2026-01-01.json", "sections": sections,
              "goals": goals.evaluate(sections, "full")}
    text = report.markdown(result)
    assert "| rms_norm | TB/s | 2.7 |" in text and "29 passed, 1 failed" in text and "error" in text
    assert len(text) < 12000  # what a lease returns of the output
    rows = report.readme_table(result).strip().splitlines()[2:]
    assert rows and all(r.startswith("| NVIDIA H100 80GB HBM3 | 2026-01-01 |") for r in rows)
    assert any("rms_norm fwd+bwd | 2.7 TB/s | 1.5 TB/s (eager)" in r for r in rows)


def test_junit_summary_counts_and_names_failures(tmp_path):
    from benchmarks.gpu.correctness import junit_summary
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_k" name="a"/>'
        '<testcase classname="tests.test_k" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_k" name="c"><skipped/></testcase>'
        '<testcase classname="" name="tests.test_m"><error message="collection failure"/></testcase>'
        '</testsuite></testsuites>')
    got = junit_summary(str(tmp_path / "j.xml"))
    assert got == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1, "failing": ["tests.test_k::b", "::tests.test_m"],
                   "why": {"tests.test_k::b": "x |", "::tests.test_m": "collection failure |"}}


def test_a_killed_pytest_run_is_counted_from_its_verbose_lines():
    from benchmarks.gpu.correctness import verbose_summary
    out = ("tests/test_k.py::test_a[fp32] PASSED     [ 10%]\ntests/test_k.py::test_b FAILED   [ 20%]\n"
           "tests/test_k.py::test_c SKIPPED (no CUDA)   [ 30%]\ntests/test_k.py::test_d ")
    assert verbose_summary(out) == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                                    "failing": ["tests/test_k.py::test_b"], "why": {}}
    xdist = ("[gw0] [ 10%] PASSED tests/test_k.py::test_a[fp32] \n[gw3] [ 20%] ERROR tests/test_k.py::test_b \n"
             "[gw1] [100%] SKIPPED tests/test_k.py::test_c \n")  # pytest-xdist's workers on the lease machine
    assert verbose_summary(xdist) == {"passed": 1, "failed": 0, "errors": 1, "skipped": 1,
                                      "failing": ["tests/test_k.py::test_b"], "why": {}}


def test_micro_batch_search_steps_down_on_out_of_memory(tmp_path, monkeypatch):
    from benchmarks.gpu import training
    from benchmarks.gpu.context import Options, Record
    tried = []

    class FakeBench:
        def __init__(self, family, size, micro, device):
            tried.append(micro)
            if micro > 16:
                raise torch.cuda.OutOfMemoryError("planted")
            self.micro, self.errors, self.closed = micro, {}, False

        def rounds(self, count, measured, phase):  # at 16 the build fits and a step does not
            if self.micro > 8:
                self.errors[("transformers", phase)] = "OutOfMemoryError: planted"

        def close(self):
            self.closed = True

    monkeypatch.setattr(training, "Bench", FakeBench)
    monkeypatch.setitem(training.MICRO, "gpt2", ((32, 16, 8, 4), (16, 8), (2,)))
    opts = Options("cpu", False, False, str(tmp_path), time.time())
    record = Record("training", str(tmp_path / "r.json"), opts, time.time() + 60)
    assert isinstance(training.fit(opts, record, "gpt2"), FakeBench) and tried == [32, 16, 8]
    assert record.data["figures"]["gpt2_micro_batch"]["value"] == 8 and len(record.data["notes"]) == 2


def test_fp32_step_equality_is_judged_on_gradients_and_the_whole_models_weights():
    """A tensor whose gradient is rounding noise (GPT-2's key bias) moves either way in AdamW's first step: the
    whole model's weights still agree; a gradient 1e-4 off does not pass."""
    from benchmarks.gpu.fp32_step import judge
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(256, 256, generator=g), torch.zeros(64)
    grads = {"w": torch.randn(256, 256, generator=g), "b": torch.full((64,), 1e-12)}
    ref = {"loss": 2.0, "grad_norm": 3.0, "before": {"w": w, "b": b}, "grads": grads,
           "after": {"w": w - 1e-3 * grads["w"].sign(), "b": b - 1e-3}}
    noisy_bias = {**ref, "after": {"w": ref["after"]["w"], "b": b + torch.tensor([1e-3] + [-1e-3] * 63)}}
    verdict = judge(noisy_bias, ref)
    assert verdict["equal"] and verdict["weights_rel_diff"] > 0.1 and verdict["worst_weights"][0][0] == "b"
    off = {**ref, "grads": {"w": grads["w"] * (1 + 1e-4), "b": grads["b"]}}
    assert not judge(off, ref)["equal"] and judge(off, ref)["worst_grads"][0][0] == "w"



def test_runs_merge_later_sections_over_earlier_and_count_hand_run_tests():
    from benchmarks.gpu.merge import merge
    run = lambda sections, cmd: {"card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "mode": "full",  # noqa: E731
                                 "command": cmd, "total_s": 100.0, "sections": sections, "save_as": "x"}
    first = run({"card": _section(figures={"copy_tbps": {"value": 2.9}}), "kernels": _section(tables={"kernels": []}),
                 "training": _section(tables={"training": []})}, "full")
    second = run({"card": _section(figures={"copy_tbps": {"value": 3.0}}), "training": _section(tables={"training": []})},
                 "--only card,training")
    log = "tests/test_a.py::test_x PASSED [ 50%]\ntests/test_a.py::test_y FAILED [100%]\n"
    merged = merge([first, second], ["a1", "b2"], [("gloo ranks", log, "b2")])
    s = merged["sections"]
    assert s["card"]["figures"]["copy_tbps"]["value"] == 3.0 and s["card"]["run"] == 2 and s["kernels"]["run"] == 1
    assert [r["commit"] for r in merged["runs"]] == ["a1", "b2"] and merged["total_s"] == 200.0
    (row,) = s["correctness"]["tables"]["pytest_gpu"]
    assert (row["passed"], row["failed"], row["failing"], row["group"]) == (1, 1, ["tests/test_a.py::test_y"],
                                                                           "gloo ranks")
    with pytest.raises(ValueError, match="different cards"):
        merge([first, {**second, "card": "NVIDIA H200"}], ["a", "b"], [])
    # a run without the card section (--only training) takes the named run's card; a hand-run group replaces the
    # run's row of that group (killed for time)
    killed = {"group": "gloo ranks", "passed": 2, "failed": 0, "failing": []}
    unnamed = {**run({"correctness": _section(tables={"pytest_gpu": [killed]})}, "--only correctness"),
               "card": "unknown card", "save_as": "y"}
    merged = merge([unnamed, second], ["a", "b"], [("gloo ranks", log, "a")])
    assert merged["card"] == "NVIDIA H100 80GB HBM3" and merged["save_as"] == "x"
    assert [r["passed"] for r in merged["sections"]["correctness"]["tables"]["pytest_gpu"]] == [1]
    with pytest.raises(ValueError, match="no run names its card"):
        merge([unnamed], ["a"], [])
    # a rerun --models gpt2 adds GPT-2's training rows beside the earlier run's Llama ones (and clears their skip)
    row = lambda family, rate: {"family": family, "loop": "plain", "mode": "eager", "tokens_per_s": rate}  # noqa: E731
    llama = _section(figures={"llama_micro_batch": {"value": 8}}, tables={"training": [row("llama", 1.0)],
                                                                            "profile": [row("llama", 0)]})
    llama.update(status="partial", skipped={"gpt2 training": "out of time budget"}, notes=["llama engine step: mm"])
    gpt2 = _section(figures={"gpt2_micro_batch": {"value": 32}}, tables={"training": [row("gpt2", 2.0)]})
    merged = merge([run({"training": llama}, "a"), run({"training": gpt2}, "--only training --models gpt2")],
                   ["a", "b"], [])["sections"]["training"]
    assert [(r["family"], r["run"]) for r in merged["tables"]["training"]] == [("llama", 1), ("gpt2", 2)]
    assert [r["family"] for r in merged["tables"]["profile"]] == ["llama"]
    assert merged["notes"] == ["llama engine step: mm"]
    assert set(merged["figures"]) == {"llama_micro_batch", "gpt2_micro_batch"}
    assert merged["skipped"] == {} and merged["status"] == "ok"
    again = merge([run({"training": llama}, "a"), run({"training": llama}, "b")], ["a", "b"], [])
    assert [r["run"] for r in again["sections"]["training"]["tables"]["training"]] == [2]  # the same model: replaced


def test_each_committed_gpu_result_has_its_generated_table_in_the_docs():
    """docs/evidence.md's "Measured on GPU" holds `gpu_check --table` of every committed result, unedited; the
    README's holds the newest of each card's (and no other)."""
    import glob
    import json
    from benchmarks.gpu import report
    root = os.path.join(os.path.dirname(__file__), "..")
    docs = {name: open(os.path.join(root, *name.split("/"))).read() for name in ("README.md", "docs/evidence.md")}
    paths = glob.glob(os.path.join(root, "benchmarks", "results", "gpu-*.json"))
    assert paths, "no GPU results committed"
    newest = {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        table = report.readme_table(result)
        assert table in docs["docs/evidence.md"], f"{os.path.basename(path)}: its table is not in docs/evidence.md"
        if result["date"] > newest.get(result["card"], ("", ""))[0]:
            newest[result["card"]] = (result["date"], table)
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        shown = report.readme_table(result) in docs["README.md"]
        assert shown == (newest[result["card"]][0] == result["date"]), \
            f"{os.path.basename(path)}: the README shows the newest result of each card, and only those"


def test_publish_puts_a_results_table_where_the_docs_test_looks(tmp_path, capsys):
    """benchmarks/gpu/publish.py: a newer run of a card replaces that card's README table and goes first in
    docs/evidence.md, beside the older runs; a new card's table is added; an older run or a second call changes
    nothing in the README; what the previous test asks of the real docs then holds for the copies."""
    import copy
    import glob
    from benchmarks.gpu import publish, report
    root = os.path.join(os.path.dirname(__file__), "..")
    docs = {name: tmp_path / name.replace("/", "-") for name in ("README.md", "docs/evidence.md")}
    for name, path in docs.items():
        path.write_text(open(os.path.join(root, *name.split("/"))).read())
    committed = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(root, "benchmarks/results/gpu-*.json")))]
    h200 = max((r for r in committed if r["card"] == "NVIDIA H200"), key=lambda r: r["date"])
    newer, other = copy.deepcopy(h200), copy.deepcopy(h200)
    newer["date"], newer["runs"][0]["commit"] = "2099-01-01", "abc1234"
    other["card"], other["sections"]["card"]["figures"]["name"]["value"] = "NVIDIA B200", "NVIDIA B200"

    def run(result, name):
        path = tmp_path / name
        path.write_text(json.dumps(result))
        assert publish.main([str(path), "--readme", str(docs["README.md"]),
                             "--evidence", str(docs["docs/evidence.md"])]) == 0
        return capsys.readouterr().out

    assert "replaced by 2099-01-01's" in run(newer, "newer.json")
    readme, evidence = (docs[n].read_text() for n in ("README.md", "docs/evidence.md"))
    assert report.readme_table(newer) in readme and report.readme_table(h200) not in readme
    h100 = max((r for r in committed if r["card"].startswith("NVIDIA H100")), key=lambda r: r["date"])
    assert report.readme_table(h100) in readme  # the other card's stays
    assert all(report.readme_table(r) in evidence for r in committed + [newer])
    assert evidence.index(report.readme_table(newer)) < evidence.index(report.readme_table(h200))
    assert "**NVIDIA H200, 2099-01-01** (driver" in evidence and "commit abc1234" in evidence
    assert run(newer, "newer.json").count("already shows it") == 2  # a second call changes nothing
    run(h200, "older.json")  # older than the one shown: the README keeps the newer table
    assert docs["README.md"].read_text() == readme
    assert "table added" in run(other, "b200.json")
    readme = docs["README.md"].read_text()
    assert readme.index(report.readme_table(other)) > readme.index(report.readme_table(newer))
    assert publish.main([str(tmp_path / "missing.json")]) == 2 and "publish.py: " in capsys.readouterr().err


def test_only_runs_the_sections_named_and_refuses_unknown_ones(tmp_path, capsys):
    from benchmarks import gpu_check
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--only", "card", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(result["sections"]) == ["card"] and result["sections"]["card"]["status"] == "ok"
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--only", "card,kernals", "--out", str(tmp_path)]) == 2
    assert "no section named kernals" in capsys.readouterr().err
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--only", "card", "--budgets", "card=0.5",
                           "--out", str(tmp_path)]) == 0  # under runner.MIN_BUDGET: the one section is skipped
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["card"]["status"] == "skipped"
    for bad, says in (("kernals=5", "no section named kernals"), ("card=soon", "seconds must be a number"),
                      ("training=300,fp8=100", "over the 360 s a dry-run run may take")):
        assert gpu_check.main(["--device", "cpu", "--dry-run", "--budgets", bad, "--out", str(tmp_path)]) == 2
        assert says in capsys.readouterr().err
    for bad in ("gpt3", "llama,,bert", ","):
        assert gpu_check.main(["--device", "cpu", "--dry-run", "--models", bad, "--out", str(tmp_path)]) == 2
        assert "--models" in capsys.readouterr().err


def test_the_default_run_fits_eight_minutes_and_quick_four():
    """Issue 31's bounds for an unattended `make gpu-check`: the default sections' budgets and graces fit 8 minutes
    (--quick: 4), leaving a 15-minute lease room for a rerun; the launch sweep runs only when named, a dry run
    runs every section, and sections given --budgets may take a lease's whole call (10 minutes), no more."""
    from benchmarks import gpu_check
    from benchmarks.gpu.runner import GRACE

    def need(argv):
        args = gpu_check.parse(["--device", "cpu"] + argv)
        mode = gpu_check.options(args).mode
        return sum(s.budget[mode] + GRACE for s in gpu_check.planned(args, mode)), gpu_check.chosen(args)

    assert need([]) == (480, ["card", "correctness", "kernels", "training", "memory", "fp8"])
    assert need(["--quick"]) == (240, need([])[1])
    assert need(["--dry-run"])[1] == SECTIONS and need(["--only", "tuning"])[1] == ["tuning"]
    fits = gpu_check.parse(["--only", "training,fp8", "--budgets", "training=220,fp8=280"])
    too_long = gpu_check.parse(["--only", "training,fp8", "--budgets", "training=300,fp8=290"])
    assert gpu_check.ceiling(fits, "full") == 600 and need(["--only", "training,fp8", "--budgets",
                                                            "training=220,fp8=280"])[0] == 520
    assert "over the 600 s a full run may take" in gpu_check.problem(too_long)
    assert gpu_check.ceiling(gpu_check.parse([]), "full") == 480


def test_models_picks_the_training_sections_models_in_order(monkeypatch):
    """--models gpt2 reruns only GPT-2's training rows (what a budget left out), without the Llama ones again."""
    from benchmarks import gpu_check
    from benchmarks.gpu import training
    from benchmarks.gpu.context import Options
    trained = []
    monkeypatch.setattr(training, "train", lambda opts, record, family, matmul: trained.append(family))
    monkeypatch.setattr(training, "process_group", lambda cuda: contextlib.nullcontext())
    record = types.SimpleNamespace(has_time=lambda what, need: True)
    for flag, want in (("gpt2", ["gpt2"]), ("gpt2,llama", ["gpt2", "llama"]), (None, ["llama", "gpt2"])):
        args = gpu_check.parse(["--device", "cpu", "--dry-run"] + (["--models", flag] if flag else []))
        trained.clear()
        training.run(Options("cpu", False, True, "out", time.time(), gpu_check.models(args)), record, {})
        assert trained == want


def test_device_timing_queues_each_call_behind_a_device_sleep(monkeypatch):
    """benchmarks.kernel_speed.median_ms on CUDA: the sleep is queued before the start event, and the events
    bracket fn alone, so the host's launch work is hidden behind the sleep instead of timed on an idle device."""
    from benchmarks import kernel_speed
    order = []

    class Event:
        def __init__(self, enable_timing):
            self.name = f"event{len(order)}"

        def record(self):
            order.append(("record", self.name))

        def elapsed_time(self, other):
            return 1.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: order.append(("sync",)))
    assert kernel_speed.median_ms(lambda: order.append(("fn",)), 2, cuda=True) == 1.5
    timed = order[3:]  # after the three warm-up calls
    assert [step[0] for step in timed] == ["sleep", "record", "fn", "record", "sync"] * 2
    assert timed[0][1] == kernel_speed.QUEUE_AHEAD_CYCLES >= 1_000_000


def test_step_profile_splits_a_steps_time_into_device_and_host(tmp_path, capsys, monkeypatch):
    """benchmarks/gpu/step_profile.py (the H200's FP8 steps were host-bound: it said so) runs on the CPU at tiny
    size: each precision's step time, host time and top operators, in its printed tables and its JSON (delayed
    scaling with the output layer in FP8 too, `delayed+head`: its products counted as the others). The
    gradient-accumulation fusion is switched on as on CUDA (fp32 here): its fused products (aten::addmm) are counted
    with the others, and the step is timed without it too."""
    import signal
    from benchmarks.gpu import step_profile
    from engine.parallel import grad_accumulation
    monkeypatch.setattr(grad_accumulation, "supported", lambda device, dtype: dtype == torch.float32)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    step_profile.main(["--size", "tiny", "--warm", "2", "--top", "4", "--precisions", "bf16,delayed+head",
                       "--out", str(tmp_path)])
    # the trainers it drove gave this process's stop-signal handlers back (left behind, they once hung the suite)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    results = json.loads((tmp_path / "step_profile.json").read_text())
    assert [r["precision"] for r in results] == ["bf16", "delayed+head"]  # +head: --fp8-output-layer
    from benchmarks.gpu import models
    from engine import flops
    cfg = models.config("llama", "tiny", 2, 2, 1, bf16=False)
    f = flops.forward_flops_per_sequence(cfg.model, cfg.model.seq_length)
    model_tflop = 3 * (f["linear"] + f["logits"]) * cfg.training.global_batch_size / 1e12
    for r in results:
        assert r["step_ms"] > 0 and r["host_self_ms"] > 0 and len(r["by_host"]) == 4 and r["by_host"][0]["calls"] > 0
        # every product of the step, bf16's and FP8's (dequantized on the CPU), once: the model's FLOPs
        assert r["products"]["tflop"] == pytest.approx(model_tflop, rel=1e-3), (r["products"], model_tflop)
        assert (r.get("fusion_gain", 0) > 0 and r.get("unfused_step_ms", 0) > 0) == (r["precision"] == "bf16")
    out = capsys.readouterr().out
    assert "## delayed+head: step" in out and "| delayed+head by host | ms | calls |" in out
    assert "; gradient-accumulation fusion " in out


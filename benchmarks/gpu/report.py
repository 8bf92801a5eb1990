"""The run as Markdown: the full table the check prints last, and docs/evidence.md's "Measured on GPU" table.

The printed table is what a lease returns (its output tail, 12,000 characters), so it is compact: one line
per figure, kernels as one row per case with a column per implementation.
"""
from __future__ import annotations

KERNEL_IMPLS = ("triton", "triton-inplace", "compile", "eager", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa",
                "reference")


def _t(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _cell(value) -> str:
    """A table cell: an error text's pipes and line breaks would otherwise break the table."""
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _n(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _count(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(result: dict) -> str:
    s = result["sections"]
    lines = [f"## gpu-check: {result['card']} · {result['mode']} · {result['date']}",
             f"commit the JSON as `{result['save_as']}`; {result['total_s']:.0f} s in all", ""]
    lines += _t(["section", "status", "seconds", "budget", "error / skipped"],
                [[name, r["status"], r["seconds"], r["budget_s"], _problems(r)] for name, r in s.items()])
    for title, part in (("card", card), ("correctness", correctness), ("kernels, forward + backward", kernels),
                        ("launch settings (TB/s)", tuning), ("training", training), ("memory", memory), ("fp8", fp8), ("goals", goals)):
        body = part(result)
        if body:
            lines += ["", f"### {title}", *body]
    return "\n".join(lines) + "\n"


def _problems(r: dict) -> str:
    text = (r.get("error") or "").strip().splitlines()[-1:] + [f"{k}: {v}" for k, v in r.get("skipped", {}).items()]
    joined = "; ".join(text)
    return (joined[:300] + "…") if len(joined) > 300 else joined


def card(result: dict) -> list:
    figs = result["sections"].get("card", {}).get("figures", {})
    return _t(["figure", "value", "unit", "anchor", "how"],
              [[k, _n(f["value"], 4), f["unit"], f["anchor"], f["note"]] for k, f in figs.items()]) if figs else []


def correctness(result: dict) -> list:
    sec = result["sections"].get("correctness", {})
    rows = [[f"fp32 step {r['family']} ({r['device']}, {r.get('kernels', 'fused')} kernels, vs cpu)",
             f"loss {r['loss_rel_diff']:.1e}, grad norm {r['grad_norm_rel_diff']:.1e}, "
             + (f"worst grad {r['worst_grad_rel_diff']:.1e}, model weights {r['model_weights_rel_diff']:.1e}, "
                if "worst_grad_rel_diff" in r else "")
             + f"worst weights {r['weights_rel_diff']:.1e}, update {r['update_rel_diff']:.1e}",
             "equal" if r["equal"] else "DIFFERENT", f"<= {r['tolerance']:.0e}"]
            for r in sec.get("tables", {}).get("fp32_step", [])]
    for r in sec.get("tables", {}).get("pytest_gpu", []):
        rows.append([f"pytest -m gpu ({r['group']})" if r.get("group") else "pytest -m gpu",
                     f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                     f"{r.get('errors', 0)} errors, {r.get('skipped', 0)} skipped",
                     ", ".join(r.get("failing", [])[:6]) or "-", "all pass"])
    collected = sec.get("figures", {}).get("pytest_gpu_collected")
    if collected:
        rows.append(["pytest -m gpu", f"{collected['value']} collected", "not run: needs CUDA", "all pass"])
    return _t(["check", "result", "verdict", "anchor"], rows) if rows else []


def kernels(result: dict) -> list:
    rows = result["sections"].get("kernels", {}).get("tables", {}).get("kernels", [])
    if not rows:
        return []
    cases = {}
    for r in rows:
        cases.setdefault(r["kernel"], {})[r["impl"]] = r
    impls = [i for i in KERNEL_IMPLS if any(i in c for c in cases.values())]
    table = []
    for kernel, by_impl in cases.items():
        unit = next((r["unit"] for r in by_impl.values() if "unit" in r), "")
        cells = [_n(by_impl[i].get("rate")) if i in by_impl and "rate" in by_impl[i] else
                 ("error" if i in by_impl else "") for i in impls]
        table.append([kernel, unit, *cells, next(iter(by_impl.values()))["anchor"]])
    return _t(["kernel", "unit", *impls, "anchor"], table)


def training(result: dict) -> list:
    rows = result["sections"].get("training", {}).get("tables", {}).get("training", [])
    table = [[r["family"], r["loop"], r["mode"], r["micro_batch"], _count(r.get("tokens_per_s")),
              _pct(r.get("mfu_989")), _pct(r.get("mfu_measured")), _n(r.get("peak_gib")), _n(r.get("planner_gib")),
              _n(r.get("loss_max_diff_vs_plain"), 2), _n(r.get("warm_up_s")), _GRADS.get(r.get("grads_match_eager")),
              (r.get("error") or "")[:120]]
             for r in rows]
    out = _t(["model", "loop", "mode", "mbs", "tokens/s", "MFU/989", "MFU/measured", "peak GiB", "planner GiB",
              "Δloss vs plain", "warm-up s", "compiled grads", "error"], table) if table else []
    prof = result["sections"].get("training", {}).get("tables", {}).get("profile", [])
    if prof:  # where a step spends its device time: the top operators per model and step (engine eager first)
        steps = dict.fromkeys((r["family"], r["phase"]) for r in prof)
        top = 8 if len(steps) == 1 else 5
        shown = [r for step in steps for r in [x for x in prof if (x["family"], x["phase"]) == step][:top]]
        out += ["", *_t(["model", "step", "operator", "device ms", "share", "calls"],
                        [[r["family"], r["phase"], r["op"], r["device_ms"], _pct(r["share"]), r["calls"]]
                         for r in shown])]
    totals = result["sections"].get("training", {}).get("tables", {}).get("product_totals", [])
    if totals:  # each profiled step's products summed, against the model's: fewer TFLOP, or above the card's rate,
        out += ["", *_t(["model", "step", "products", "TFLOP", "model's TFLOP", "device ms", "TFLOP/s", "x matmul"],
                        [[r["family"], r["phase"], r["calls"], _n(r["tflop"], 4), _n(r["model_tflop"], 4),
                          r["device_ms"], _n(r["tflops_rate"]), _n(r["rate_over_matmul"])] for r in totals])]
    gemms = result["sections"].get("training", {}).get("tables", {}).get("gemms", [])
    if gemms:  # every matrix product of each profiled step, by input shapes: where two loops' products differ
        out += ["", *_t(["model", "step", "operator", "input shapes", "device ms", "calls"],
                        [[r["family"], r["phase"], r["op"], r["shapes"], r["device_ms"], r["calls"]] for r in gemms])]
    return out


_GRADS = {True: "= eager", False: "NOT eager's", None: "-"}  # grad_check's verdict on a compiled row


def tuning(result: dict) -> list:
    rows = result["sections"].get("tuning", {}).get("tables", {}).get("tuning", [])
    # Norm rows before BWD_ROWS_PER_ITER was swept ran the backward one row a loop iteration.
    # FP8 codes rows (one pass, no backward) name their block shape; norm and RoPE rows their rows a program
    return _t(["kernel", "warps", "programs/SM", "rows/iter or block", "fwd", "bwd", "fwd+bwd"],
              [[r["kernel"], r["warps"], r.get("programs_per_sm", "-"),
                r.get("block") or r.get("rows_per_iter", 1 if r["kernel"] == "rms_norm" else "-"), _n(r["fwd_tbps"]),
                _n(r.get("bwd_tbps")), _n(r.get("fwd_bwd_tbps"))] for r in rows]) if rows else []


def memory(result: dict) -> list:
    rows = result["sections"].get("memory", {}).get("tables", {}).get("saved_bytes", [])
    table = [[r["tp"], r["sp"], r["recompute"], "yes" if r.get("packed") else "no", r["measured"], r["expected"],
              r["measured_over_expected"], _n(r["peak"])] for r in rows]
    return _t(["tp", "sp", "recompute", "packed", "saved B", "expected B", "ratio (<= 1.05)", "cuda growth B"],
              table) if table else []


def fp8(result: dict) -> list:
    sec = result["sections"].get("fp8", {})
    figs, tables = sec.get("figures", {}), sec.get("tables", {})
    rows = [[k, _n(f["value"], 4), f["unit"], f["anchor"] or f["note"]] for k, f in figs.items()]
    rows += [[f"linear {r['recipe']} {r['shape']}: device vs CPU",
              f"y {r['y_rel_diff']:.1e}, dx {r['dx_rel_diff']:.1e}, dw {r['dw_rel_diff']:.1e}", "max |Δ| / max", ""]
             for r in tables.get("fp8_linear", [])]
    rows += [[f"{r['pass']} to FP8 codes {r['shape']}", f"apart {r['apart_ms']:.3f} ms, delayed "
              f"{r['delayed_ms']:.3f} ms ({r['delayed_tbps']:.3g} TB/s), tensorwise {r['tensorwise_ms']:.3f} ms",
              f"{r['delayed_over_apart']:.2f}x apart", r["anchor"]] for r in tables.get("fp8_codes", [])]
    rows += [[f"llama step {r['precision']}", f"{r['step_s'] * 1e3:.1f} ms, {r['speedup_vs_bf16']:.2f}x bf16, loss "
              f"{r['final_loss']:.4f} ({100 * r['loss_rel_diff_vs_bf16']:.2f}%)", f"{r['steps']} steps",
              ">= 1.2x, within 1%"] for r in tables.get("fp8_step", [])]
    return _t(["figure", "value", "unit", "anchor"], rows) if rows else []


def goals(result: dict) -> list:
    return _t(["goal", "measured", "target", "verdict", "note"],
              [[g["goal"], g["measured"] or "-", g["target"], g["verdict"], g["note"]] for g in result["goals"]])


def readme_table(result: dict) -> str:
    """docs/evidence.md's "Measured on GPU" rows: the card and date on every row, Ternion beside the best baseline."""
    name, date = result["card"], result["date"]
    rows = []
    for f in ("matmul_tflops", "copy_tbps"):
        fig = result["sections"].get("card", {}).get("figures", {}).get(f)
        if fig:
            rows.append([name, date, f, f"{_n(fig['value'], 4)} {fig['unit']}", "-", fig["anchor"], "roof"])
    rows += _kernel_rows(result, name, date) + _training_rows(result, name, date) + _fp8_rows(result, name, date)
    rows += [[name, date, g["goal"], g["measured"] or "-", "-", g["target"], g["verdict"]] for g in result["goals"]
             if g["goal"].startswith("planner")]
    return "\n".join(_t(["card", "date", "what", "Ternion", "best other", "anchor", "goal"], rows)) + "\n"


def _kernel_rows(result: dict, name: str, date: str) -> list:
    out = []
    rows = [r for r in result["sections"].get("kernels", {}).get("tables", {}).get("kernels", []) if "rate" in r]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        case = [r for r in rows if r["kernel"] == kernel]
        # attention: what `auto` runs for whole attention (SDPA's cuDNN kernel), then the Triton kernel that
        # windows and packed documents run; each against the best of the rest
        kinds = ((("sdpa-cudnn",), " (auto: SDPA cuDNN)", "auto"), (("triton",), " (Triton kernel)", "Triton")) \
            if kernel.startswith("attention") else ((("triton", "triton-inplace"), "", ""),)
        for impls, label, goal_word in kinds:
            ours = max((r for r in case if r["impl"] in impls), key=lambda r: r["rate"], default=None)
            best = max((r for r in case if r["impl"] not in impls and r["impl"] != "sdpa-cudnn"),
                       key=lambda r: r["rate"], default=None)
            prefix = "cross-entropy" if kernel == "cross_entropy" else kernel
            verdict = next((g["verdict"] for g in result["goals"]
                            if g["goal"].startswith(prefix + " ") and goal_word in g["goal"]), "-")
            out.append([name, date, f"{kernel} fwd+bwd{label}", _rate(ours), _rate(best, True), case[0]["anchor"],
                        verdict])
    return out


def _fp8_rows(result: dict, name: str, date: str) -> list:
    sec = result["sections"].get("fp8", {})
    figs, out = sec.get("figures", {}), []
    if "fp8_gemm_tflops" in figs and "bf16_gemm_tflops" in figs:
        out.append([name, date, "FP8 GEMM 8192³ (e4m3, tensor scales)", f"{_n(figs['fp8_gemm_tflops']['value'], 4)} "
                    "TFLOP/s", f"{_n(figs['bf16_gemm_tflops']['value'], 4)} TFLOP/s (bf16)",
                    figs["fp8_gemm_tflops"]["anchor"], "-"])
    for r in sec.get("tables", {}).get("fp8_step", []):
        if r["fp8"]:
            verdict = next((g["verdict"] for g in result["goals"] if g["goal"].startswith(r["precision"] + " 1.3B step")),
                           "-")
            out.append([name, date, f"1.3B step, {r['precision']}", f"{r['speedup_vs_bf16']:.2f}x bf16, loss "
                        f"{100 * r['loss_rel_diff_vs_bf16']:.2f}% off", "1.00x (bf16)", ">= 1.2x, within 1%", verdict])
    return out


def _rate(r, which: bool = False) -> str:
    if r is None:
        return "-"
    return f"{r['rate']:.4g} {r['unit']}" + (f" ({r['impl']})" if which else "")


def _training_rows(result: dict, name: str, date: str) -> list:
    out = []
    rows = [r for r in result["sections"].get("training", {}).get("tables", {}).get("training", []) if r.get("step_s")]
    goal = next((g["verdict"] for g in result["goals"] if g["goal"].startswith("engine 1.3B step")), "-")
    for family in dict.fromkeys(r["family"] for r in rows):
        case = [r for r in rows if r["family"] == family]
        ours = next((r for r in case if r["loop"] == "engine" and r["mode"] == "eager"), None)
        best = max((r for r in case if r is not ours and r.get("grads_match_eager") is not False),  # as the goal
                   key=lambda r: r["tokens_per_s"], default=None)
        out.append([name, date, f"{case[0]['model']} training, micro batch {case[0]['micro_batch']}", _speed(ours),
                    _speed(best, True), case[0]["mfu_anchor"], goal if family == "llama" else "-"])
    return out


def _speed(r, which: bool = False) -> str:
    if r is None:
        return "-"
    text = f"{_count(r['tokens_per_s'])} tokens/s, MFU {_pct(r['mfu_989'])}"
    return text + (f" ({r['loop']} {r['mode']})" if which else "")

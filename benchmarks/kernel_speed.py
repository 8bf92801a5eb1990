"""Times each fused kernel against PyTorch: achieved GB/s for the bandwidth-bound ops, TFLOP/s for attention.

    python benchmarks/kernel_speed.py [--out FILE.json] [--ops rms_norm,swiglu,...] [--reps N] [--dtype D] [--quick]

On a GPU it compares the Triton kernels with PyTorch eager and torch.compile (and, for attention, with
every SDPA backend and flash-attn when installed) at training sizes. Without one it times the PyTorch
references against eager at tiny sizes, so the script itself stays exercised; Triton needs CUDA.
Prints a table and writes a JSON file that names the device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.parallel.topology import ParallelContext
from kernels import dispatch, reference

EPS = 1e-5


QUEUE_AHEAD_CYCLES = 4_000_000  # ~2 ms of the GPU's clock (1.98 GHz on the H100/H200): more than fn's host time


def significant(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits: a fixed number of decimals rounds a loaded CPU's small rates to 0."""
    return float(f"{x:.{digits}g}")


def median_ms(fn, reps: int, cuda: bool) -> float:
    """Median milliseconds of fn() after warm-up (device events on CUDA, so queued work is not mistaken for done).

    On CUDA each timed call is queued behind a ~2 ms device-side sleep, so the start event, fn's kernels and the
    end event wait on the device together and the events time the kernels alone, not the host's launch work
    (Triton's Python launcher, autograd) on an idle device, as in training, where the host runs ahead. Without
    it, the H200 sweep of 2026-11-26 put RMSNorm's forward anywhere from 2.0 to 2.7 TB/s across settings that
    change only its backward, and the short kernels (norms, RoPE: 60-150 us of traffic) were timed below the
    long ones (SwiGLU, cross-entropy) by more than their bytes explain."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(shapes, dtype, device, grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_(grad) for s in shapes]


def _norm_case(kind, m, h, dtype, device):
    x, r = _inputs([(m, h), (m, h)], dtype, device)
    w, b = _inputs([(h,), (h,)], dtype, device)
    es = x.element_size() * m * h
    if kind == "rms_norm":
        impls = {"triton": lambda: dispatch.rms_norm(x, w, EPS), "reference": lambda: reference.rms_norm(x, w, EPS),
                 "eager": lambda: F.rms_norm(x, (h,), w, EPS)}
        return impls, [x, w], 2 * es, 3 * es, {"shape": [m, h]}
    if kind == "layer_norm":
        impls = {"triton": lambda: dispatch.layer_norm(x, w, b, EPS),
                 "reference": lambda: reference.layer_norm(x, w, b, EPS),
                 "eager": lambda: F.layer_norm(x, (h,), w, b, EPS)}
        return impls, [x, w, b], 2 * es, 3 * es, {"shape": [m, h]}
    impls = {"triton": lambda: dispatch.add_rms_norm(x, r, w, EPS),
             "reference": lambda: reference.add_rms_norm(x, r, w, EPS),
             "eager": lambda: (lambda s: (F.rms_norm(s, (h,), w, EPS), s))(x + r)}
    return impls, [x, r, w], 4 * es, 4 * es, {"shape": [m, h]}


def _rope_case(s, b, n, d, dtype, device):
    (x,) = _inputs([(s, b, n, d)], dtype, device)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), 10000.0 ** (-torch.arange(0, d, 2) / d)).to(device)
    impls = {"triton": lambda: dispatch.apply_rope(x, freqs), "reference": lambda: reference.apply_rope(x, freqs)}
    # No built-in RoPE op exists; "eager" is the reference formula, which is what a model would write.
    impls["eager"] = impls["reference"]
    es = x.numel() * x.element_size()
    return impls, [x], 2 * es, 2 * es, {"shape": [s, b, n, d]}


def _swiglu_case(m, h, dtype, device):
    gate, up = _inputs([(m, h), (m, h)], dtype, device)
    impls = {"triton": lambda: dispatch.swiglu(gate, up), "reference": lambda: reference.swiglu(gate, up),
             "eager": lambda: F.silu(gate) * up}
    es = gate.numel() * gate.element_size()
    return impls, [gate, up], 3 * es, 5 * es, {"shape": [m, h]}


def _ce_case(n, v, dtype, device):
    (logits,) = _inputs([(n, v)], dtype, device)
    target = torch.randint(0, v, (n,), device=device)
    # The engine's op at tp 1: the reference primitives on CPU, Triton on CUDA.
    def engine(inplace):
        return lambda: vocab_parallel_cross_entropy(logits, target, ParallelContext(), v, inplace_backward=inplace)
    impls = {"triton": engine(False), "reference": engine(False),
             "eager": lambda: F.cross_entropy(logits.float(), target, reduction="none"),
             # Last, because its backward overwrites the logits: the extra memory is then O(rows).
             "triton-inplace": engine(True)}
    es = logits.numel() * logits.element_size()
    return impls, [logits], es, 2 * es, {"shape": [n, v], "fp32_logits_mib": n * v * 4 / 2**20}


def _attention_case(b, s, nq, nkv, d, dtype, device):
    q, k, v = _inputs([(b, s, nq, d), (b, s, nkv, d), (b, s, nkv, d)], dtype, device)
    impls = {"triton": lambda: dispatch.attention(q, k, v, backend="triton"),
             "reference": lambda: dispatch.attention(q, k, v, backend="local")}
    # SDPA gets its kv heads expanded outside the timed region (its fastest kernels want equal heads).
    qt, kt, vt = (t.detach().transpose(1, 2).repeat_interleave(nq // t.shape[2], dim=1).requires_grad_(True)
                  for t in (q, k, v))
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            impls[name] = run
        if dispatch.flash_attn_available():
            impls["flash-attn"] = lambda: dispatch.attention(q, k, v, backend="flash")
    else:
        impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    flops = 4 * b * nq * s * s * d / 2  # causal: half the score matrix
    # Each impl differentiates its own leaves; SDPA's are the transposed, expanded copies.
    return impls, {"sdpa": [qt, kt, vt], "default": [q, k, v]}, flops, 2.5 * flops, {"shape": [b, s, nq, nkv, d]}


def cases(device, dtype, quick=False):
    """Name -> case builder at training sizes on CUDA (unless `quick`), tiny ones elsewhere."""
    if device == "cuda" and not quick:
        return {
            "rms_norm": lambda: _norm_case("rms_norm", 16384, 8192, dtype, device),
            "layer_norm": lambda: _norm_case("layer_norm", 16384, 8192, dtype, device),
            "add_rms_norm": lambda: _norm_case("add_rms_norm", 16384, 8192, dtype, device),
            "rope": lambda: _rope_case(4096, 4, 32, 128, dtype, device),
            "swiglu": lambda: _swiglu_case(16384, 14336, dtype, device),
            "cross_entropy": lambda: _ce_case(8192, 131072, dtype, device),
            "attention_d128": lambda: _attention_case(2, 4096, 32, 8, 128, dtype, device),
            "attention_d64": lambda: _attention_case(2, 4096, 32, 8, 64, dtype, device),
        }
    return {
        "rms_norm": lambda: _norm_case("rms_norm", 256, 512, dtype, device),
        "layer_norm": lambda: _norm_case("layer_norm", 256, 512, dtype, device),
        "add_rms_norm": lambda: _norm_case("add_rms_norm", 256, 512, dtype, device),
        "rope": lambda: _rope_case(64, 2, 4, 64, dtype, device),
        "swiglu": lambda: _swiglu_case(256, 1024, dtype, device),
        "cross_entropy": lambda: _ce_case(256, 4096, dtype, device),
        "attention_d64": lambda: _attention_case(1, 128, 4, 2, 64, dtype, device),
    }


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _measure(name, impl, fn, leaves, fwd_work, bwd_work, reps, cuda):
    """Forward time, backward time (over a retained graph) and, on CUDA, peak memory beyond the inputs."""
    row = {"kernel": name, "impl": impl}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = _first(fn())
    grad = torch.ones_like(out)
    torch.autograd.grad(out, leaves, grad, retain_graph=True)
    if cuda:
        torch.cuda.synchronize()
        row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    row["fwd_ms"] = median_ms(fn, reps, cuda)
    row["bwd_ms"] = median_ms(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), reps, cuda)
    unit, scale = ("tflops", 1e-12) if name.startswith("attention") else ("gbps", 1e-9)
    row[f"fwd_{unit}"] = significant(fwd_work * scale / (row["fwd_ms"] * 1e-3))
    row[f"bwd_{unit}"] = significant(bwd_work * scale / (row["bwd_ms"] * 1e-3))
    row[f"fwd_bwd_{unit}"] = significant((fwd_work + bwd_work) * scale / ((row["fwd_ms"] + row["bwd_ms"]) * 1e-3))
    row["fwd_ms"], row["bwd_ms"] = round(row["fwd_ms"], 4), round(row["bwd_ms"], 4)
    return row


def attention_grid(device, dtype, seqs=(2048, 4096, 8192), dims=(64, 128), tokens=16384, hidden=2048) -> dict:
    """Causal attention at the FlashAttention papers' benchmark shapes: batch x seq = `tokens`, heads x head dim
    = `hidden`, as many key/value heads as query heads, so the published TFLOP/s are comparable."""
    return {f"attention_d{d}_s{s}": (lambda s=s, d=d: _attention_case(tokens // s, s, hidden // d, hidden // d, d,
                                                                       dtype, device))
            for d in dims for s in seqs}


def measure_case(name, case, device, reps) -> list:
    """Rows of every implementation of one case on `device` (`case()` builds them): the Triton kernel where CUDA
    and triton are present, torch.compile of the eager function on CUDA, then the rest; a failing one is a row
    with its error."""
    cuda = device == "cuda"
    impls, leaves, fwd_work, bwd_work, meta = case()
    if cuda:
        impls.pop("reference")
        if "eager" in impls and not name.startswith("attention"):
            impls = {"compile": torch.compile(impls["eager"]), **impls}
    if not (cuda and dispatch.triton_available()):
        impls.pop("triton", None)
        impls.pop("triton-inplace", None)
    rows = []
    for impl, fn in impls.items():
        own = leaves if isinstance(leaves, list) else leaves["sdpa" if impl.startswith("sdpa") else "default"]
        try:
            rows.append({**_measure(name, impl, fn, own, fwd_work, bwd_work, reps, cuda), **meta})
        except Exception as exc:  # one backend failing (unsupported shape, compile error) must not stop the rest
            rows.append({"kernel": name, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:200]})
    if cuda:
        torch.cuda.empty_cache()
    return rows


def run(ops, reps, dtype_name, quick=False):
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, dtype_name) if cuda else torch.float32
    notes = []
    if not (cuda and dispatch.triton_available()):
        notes.append("Triton kernels need CUDA and triton: timing the PyTorch references against eager only")
    if not cuda:
        notes.append("torch.compile is skipped on CPU (its C++ build would dominate a smoke run)")
    todo = cases(device, dtype, quick)
    rows = [row for name in ops or list(todo) if name in todo for row in measure_case(name, todo[name], device, reps)]
    name = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"
    return {"device": name, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "triton": _version("triton"), "flash_attn": _version("flash_attn"), "notes": notes, "results": rows}


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _table(report) -> str:
    lines = [f"device: {report['device']}  dtype: {report['dtype']}  torch {report['torch']}  "
             f"triton {report['triton']}  flash-attn {report['flash_attn']}"]
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append(f"{'kernel':<16}{'impl':<16}{'fwd ms':>10}{'fwd rate':>16}{'bwd ms':>10}{'bwd rate':>16}"
                 f"{'peak MiB':>10}")
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['kernel']:<16}{r['impl']:<16}  error: {r['error']}")
            continue
        unit = "tflops" if "fwd_tflops" in r else "gbps"
        label = "TFLOP/s" if unit == "tflops" else "GB/s"
        lines.append(f"{r['kernel']:<16}{r['impl']:<16}{r['fwd_ms']:>10.3f}{r['fwd_' + unit]:>9.4g} {label:<6}"
                     f"{r['bwd_ms']:>10.3f}{r['bwd_' + unit]:>9.4g} {label:<6}{r.get('peak_extra_mib', '-'):>10}")
    return "\n".join(lines)


def _targets(report) -> list:
    """The issue's acceptance figures, checked against this run's Triton rows (GPU runs only)."""
    rows = {(r["kernel"], r["impl"]): r for r in report["results"] if "error" not in r}
    lines = []
    for kernel in ("rms_norm", "layer_norm", "rope", "swiglu"):
        r = rows.get((kernel, "triton"))
        if r:
            verdict = "meets" if r["fwd_gbps"] >= 2600 else "misses"
            lines.append(f"target {kernel} forward >= 2600 GB/s: {r['fwd_gbps']:.0f} GB/s, {verdict}")
    r = rows.get(("attention_d128", "triton"))
    sdpa = [v for (k, impl), v in rows.items() if k == "attention_d128" and impl.startswith("sdpa")]
    if r and sdpa:
        best = min(sdpa, key=lambda x: x["fwd_ms"] + x["bwd_ms"])
        verdict = "meets" if r["fwd_ms"] + r["bwd_ms"] <= best["fwd_ms"] + best["bwd_ms"] else "misses"
        lines.append(f"target attention d128 fwd+bwd <= best SDPA ({best['impl']}): "
                     f"{r['fwd_bwd_tflops']:.0f} vs {best['fwd_bwd_tflops']:.0f} TFLOP/s, {verdict}")
    r = rows.get(("cross_entropy", "triton-inplace"))
    if r and "peak_extra_mib" in r:
        limit = r["fp32_logits_mib"] / 4
        verdict = "meets" if r["peak_extra_mib"] <= limit else "misses"
        lines.append(f"target cross-entropy extra memory <= {limit:.0f} MiB (a quarter of fp32 logits): "
                     f"{r['peak_extra_mib']:.0f} MiB, {verdict}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="kernels_benchmark.json", help="JSON report path")
    parser.add_argument("--ops", default="", help="comma-separated subset of kernels (default: all)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="GPU dtype")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on any device (a smoke run)")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    known = set(cases("cuda", torch.float32)) | set(cases("cpu", torch.float32))
    unknown = [o for o in ops if o not in known]
    if unknown or args.reps < 1:
        what = f"unknown kernel(s) {','.join(unknown)}; choose from {','.join(sorted(known))}" if unknown \
            else f"got {args.reps}, need at least 1"
        print(f"benchmarks/kernel_speed.py: {'--ops' if unknown else '--reps'}: {what}", file=sys.stderr)
        return 2
    report = run(ops, args.reps, args.dtype, args.quick)
    report["targets"] = _targets(report)
    print(_table(report))
    for line in report["targets"]:
        print(line)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

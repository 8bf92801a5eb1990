"""Section 1, the card: what it is, and the two roofs every later figure is held against.

The roofs are measured, not read off the datasheet (METHOD.md: "two numbers first"): a bf16 matrix product at
8192^3 on random inputs (never zeros: they run faster than real data) and a device-to-device copy of 1 GiB,
counting the bytes read plus the bytes written. Both are medians over device-event-timed repetitions after
warm-up. KINDS.md's readings on this workplace's cards are the anchors: 798 TFLOP/s and 3.0 TB/s on an H100,
788 TFLOP/s and 4.3 TB/s on an H200.
"""
from __future__ import annotations

import importlib
import platform
import subprocess

import torch

from benchmarks.kernel_speed import median_ms, significant

MATMUL_ANCHOR = "~790 TFLOP/s (H100 798, H200 788 measured here)"


def copy_anchor(name: str) -> str:
    return "~4.3 TB/s (H200)" if "H200" in name else "~3.0 TB/s (H100)" if "H100" in name else "~3.0 H100, ~4.3 H200"


def run(opts, record, earlier) -> None:
    name = describe(opts, record)
    n = opts.pick(8192, 8192, 256 if not opts.cuda else 1024)
    dtype = torch.bfloat16 if opts.cuda else torch.float32
    tflops = matmul_tflops(n, dtype, opts.device)
    record.figure("matmul_tflops", significant(tflops), "TFLOP/s", MATMUL_ANCHOR if opts.cuda else "",
                  f"{str(dtype).removeprefix('torch.')} {n}^3, random inputs, median")
    size = opts.pick(2**30, 2**30, 2**23)
    record.figure("copy_tbps", significant(copy_tbps(size, opts.device)), "TB/s", copy_anchor(name) if opts.cuda else "",
                  f"{size / 2**20:.0f} MiB copy, read + write counted, median")


def describe(opts, record) -> str:
    """Record the card's name, driver and the software versions; return the name."""
    if opts.cuda:
        props = torch.cuda.get_device_properties(0)
        name = props.name
        record.figure("memory_gib", round(props.total_memory / 2**30, 1), "GiB")
        record.figure("multiprocessors", props.multi_processor_count, "SMs")
        record.figure("capability", f"{props.major}.{props.minor}", "")
        record.figure("driver", _driver(), "")
        record.figure("cuda", torch.version.cuda, "")
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    record.figure("name", name, "")
    for module in ("torch", "triton", "transformers"):
        record.figure(f"{module}_version", _version(module), "")
    return name


def matmul_tflops(n: int, dtype, device: str) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b, 30, device == "cuda") * 1e-3) / 1e12


def copy_tbps(nbytes: int, device: str) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), 30, device == "cuda") * 1e-3) / 1e12


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # noqa: BLE001 - missing or broken: say which
        return f"not importable ({type(exc).__name__})"

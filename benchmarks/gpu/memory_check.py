"""Section 5, memory: the planner's prediction against the allocator, and what one layer saves for backward.

(1) Each training case's measured peak (training section) against engine.planner.memory.memory_per_gpu for the
same layout, as a ratio; the goal is the engine's within 10%. (2) benchmarks/memory.py's saved-bytes check
with the device given: every tensor autograd keeps for one Llama-shaped layer against the analytic set
(Korthikanti et al. 2022 with flash attention), plus on CUDA the allocator's growth over the layer's forward.
On one GPU it runs the tp 1 cases (its tp 2 cases need two ranks); on the CPU, all of them on two gloo ranks.
"""
from __future__ import annotations

from benchmarks import memory as saved_bytes
from benchmarks.gpu.context import NEEDS_CUDA

PLANNER_ANCHOR = "planner within 10% of measured (goal, engine rows)"


def run(opts, record, earlier) -> None:
    """The planner rows come from the training section's record (its models are gone by now)."""
    for row in earlier.get("training", {}).get("tables", {}).get("training", []):
        ratio = row.get("planner_over_measured")
        record.row("planner", {k: row.get(k) for k in ("family", "loop", "mode", "micro_batch", "peak_gib",
                                                      "planner_gib", "planner_over_measured", "planner_precision")},
                   f"{row['family']} {row['loop']} {row['mode']}: planner {row['planner_gib']:.3f} GiB vs measured "
                   + (f"{row['peak_gib']:.3f} GiB, ratio {ratio:.3f}" if ratio else NEEDS_CUDA)
                   + f" (anchor {PLANNER_ANCHOR})")
    if not record.has_time("benchmarks/memory.py", 10.0):
        return
    rows = saved_bytes.run(opts.device)
    for r in rows:
        ratio = r["measured"] / r["expected"]
        extra = {"storages": r["storages"], "items": r["items"]} if ratio > saved_bytes.TARGET else {}  # what is more
        record.row("saved_bytes", {k: r.get(k) for k in ("tp", "sp", "recompute", "packed", "measured", "expected",
                                                        "planner", "peak")}
                   | {"measured_over_expected": round(ratio, 4)} | extra,
                   f"saved for backward tp {r['tp']} sp {r['sp']} recompute {r['recompute']}"
                   f"{' packed' if r.get('packed') else ''}: {r['measured']:,} B "
                   f"vs expected {r['expected']:,} (ratio {ratio:.3f}; anchor <= {saved_bytes.TARGET})"
                   + (f", cuda growth {r['peak']:,} B" if r["peak"] is not None else ""))
    record.figure("saved_bytes_worst_ratio", round(max(r["measured"] / r["expected"] for r in rows), 4), "",
                  f"<= {saved_bytes.TARGET}")

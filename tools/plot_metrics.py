"""Draw training curves from one or more metrics files into a single PNG.

    python tools/plot_metrics.py FILE.jsonl... --out FILE.png

Panels: loss (train solid, validation dashed with markers), learning rate, gradient norm, throughput
(tokens/s), MFU and TFLOP/s per GPU. Several files are overlaid, one colour each. Spike and rollback
events are marked with vertical lines; skipped steps with small crosses on the loss panel. A resumed
or rolled-back run appends to its file, so for each iteration the last record wins.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter

PANELS = (  # (record key, title, log scale)
    ("lm_loss", "loss", False),
    ("lr", "learning rate", False),
    ("grad_norm", "gradient norm", True),
    ("tokens_per_sec", "throughput (tokens/s, all GPUs)", False),
    ("mfu", "MFU", False),
    ("tflops_per_gpu", "TFLOP/s per GPU", False),
)
EVENT_STYLE = {"rollback": ("tab:red", "-"), "spike": ("tab:orange", "--")}
SKIP_EVENTS = ("skip", "skipped", "nan")


class UsageError(Exception):
    pass


def load_run(path: str) -> dict:
    """{"train": {it: record}, "valid": {it: record}, "events": [record]} with the last record per key."""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found; pass metrics files written by a training run (metrics.jsonl)")
    train, valid, events, bad = {}, {}, [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                it = int(r["iteration"])
            except (ValueError, KeyError, TypeError):
                bad += 1  # a line cut short by a crash: skip it
                continue
            if "event" in r:
                events.append(r)
            elif r.get("split") == "valid":
                valid[it] = r
            else:
                train[it] = r
    if not train and not valid:
        raise UsageError(f"{path}: no training or validation records; is this a metrics.jsonl file?")
    if bad:
        print(f"{path}: skipped {bad} unreadable lines", file=sys.stderr)
    # Events of iterations that a rollback replayed are kept: they are what the run went through.
    return {"train": train, "valid": valid, "events": events}


def labels_for(paths: list) -> list:
    """Legend names: file names, or their folders when the files share a name (runs/a/metrics.jsonl)."""
    if len(paths) == 1:
        return [""]  # one run needs no name in its legend
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) < len(names):
        names = [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in paths]
    if len(set(names)) < len(names):
        names = list(paths)
    return names


def series(records: dict, key: str) -> tuple:
    points = sorted((it, r[key]) for it, r in records.items() if isinstance(r.get(key), (int, float)))
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: list, labels: list, out: str) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, title, log), ax in zip(PANELS, axes.flat):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        drawn, values = False, []
        for i, (run, label) in enumerate(zip(runs, labels)):
            colour = colours[i % len(colours)]
            xs, ys = series(run["train"], key)
            if xs:
                ax.plot(xs, ys, color=colour, lw=1.2, label=f"{label} train".strip() if key == "lm_loss" else label)
                drawn, values = True, values + ys
            if key == "lm_loss":
                drawn |= _loss_extras(ax, run, label, colour)
        for ev in (ev for run in runs for ev in run["events"] if drawn and ev["event"] in EVENT_STYLE):
            c, style = EVENT_STYLE[ev["event"]]
            ax.axvline(ev["iteration"], color=c, ls=style, lw=0.9, alpha=0.7)
        if log and values and min(values) > 0 and max(values) > 20 * min(values):  # log helps only wide ranges
            ax.set_yscale("log")
        if key == "mfu" and drawn:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if not drawn:
            hint = " (needs a GPU preset or --peak-tflops)" if key == "mfu" else ""
            ax.text(0.5, 0.5, f"no data{hint}", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif key == "lm_loss" or len(runs) > 1:
            ax.legend(fontsize=8)
    _event_legend(fig, runs)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _loss_extras(ax, run, label, colour) -> bool:
    """Validation loss and skipped steps on the loss panel."""
    xs, ys = series(run["valid"], "lm_loss")
    if xs:
        ax.plot(xs, ys, color=colour, ls="--", marker="o", ms=4, lw=1.2, label=f"{label} valid".strip())
    skipped = sorted({ev["iteration"] for ev in run["events"] if ev["event"] in SKIP_EVENTS})
    if skipped:
        ax.plot(skipped, [_near(run["train"], it) for it in skipped], "x", color="black", ms=7,
                label=f"{label} skipped step".strip())
    return bool(xs)


def _near(train: dict, it: int) -> float:
    """A finite loss close to iteration `it`, to place a marker for a step whose own loss was NaN."""
    finite = [(abs(i - it), r["lm_loss"]) for i, r in train.items() if isinstance(r.get("lm_loss"), (int, float))]
    return min(finite)[1] if finite else 0.0


def _event_legend(fig, runs) -> None:
    kinds = {ev["event"] for run in runs for ev in run["events"]}
    handles = [Line2D([], [], color=c, ls=s, label=k) for k, (c, s) in EVENT_STYLE.items()
               if k in kinds]
    if handles:
        fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9, title="events")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="metrics files (overlaid)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    try:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise UsageError(f"--out {args.out}: directory {out_dir} does not exist; create it first")
        runs = [load_run(path) for path in args.files]
    except UsageError as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 2
    plot(runs, labels_for(args.files), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

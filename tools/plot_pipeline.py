"""Draw a pipeline schedule from the trainer's trace (--pipeline-trace) as a timeline PNG.

    python tools/plot_pipeline.py TRACE --out FILE.png

TRACE is a JSON-lines file, a directory of them, or the prefix of per-rank files TRACE.rank{R}.jsonl
(TRACE may end in .jsonl). Each line is one forward or backward pass of one microbatch:
    {"rank": R, "pp_rank": P, "kind": "F"|"B", "microbatch": M, "chunk": C, "start": t0, "end": t1}
with wall-clock times (time.time(), seconds), and optionally "iteration": then one iteration is drawn
(--iteration N, default the last traced). Zero-bubble schedules (--pipeline-schedule zb-h1, zb-v) split
each backward: "B" is then the input gradient and "W" the weight gradients, drawn in a third colour.
The title names the schedule (read from the trace's shape) and compares the measured bubble with that
schedule's own ideal: its order replayed at the traced mean pass times with free communication. --replay
draws that replay itself, each rank's traced order without the timing noise of a shared CPU.
One row per rank, forward and backward in two colours,
later virtual-pipeline chunks in lighter shades, microbatch numbers inside boxes wide enough to hold
them. Gaps are idle time: each rank's bubble is the share of the traced span it spent idle.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle

from engine.layout import SCHEDULE_KINDS, PipelineSchedule
from engine.pipeline.replay import replay

FIELDS = ("rank", "pp_rank", "kind", "microbatch", "chunk", "start", "end")
COLOURS = {"F": "#1f77b4", "B": "#ff7f0e", "W": "#2ca02c"}
OTHER_COLOUR = "#7f7f7f"
FIG_WIDTH_IN, DPI = 15.0, 110
CHAR_WIDTH_PX = 7.0  # width of one digit at the label font size, to decide whether a number fits
NOISY_EXCESS = 0.25  # measured idle share this far above the ideal: suggest --replay


class UsageError(Exception):
    pass


def trace_files(trace: str) -> list:
    """The files a TRACE argument names: itself, the .jsonl files in it, or its per-rank siblings."""
    if os.path.isfile(trace):
        return [trace]
    if os.path.isdir(trace):
        files = sorted(glob.glob(os.path.join(trace, "*.jsonl")))
    else:
        stems = {trace, trace[:-len(".jsonl")] if trace.endswith(".jsonl") else trace}
        files = sorted({f for stem in stems for f in glob.glob(glob.escape(stem) + ".rank*.jsonl")})
    if not files:
        raise UsageError(f"{trace}: no trace found (looked for the file, *.jsonl in it as a directory, and "
                         f"{trace}.rank*.jsonl); run training with --pipeline-trace {trace}")
    return files


def load_events(files: list) -> list:
    events, bad = [], 0
    for path in files:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    e = json.loads(line)
                    events.append({**e, **{k: e[k] for k in FIELDS}})
                except (ValueError, KeyError, TypeError):
                    bad += 1
    if bad:
        print(f"skipped {bad} lines that are not trace events with {', '.join(FIELDS)}", file=sys.stderr)
    if not events:
        raise UsageError(f"{', '.join(files)}: no trace events; is this a --pipeline-trace file?")
    return events


def select_iteration(events: list, iteration) -> tuple:
    """(events of one iteration, its number) when events carry "iteration"; else (all events, None).

    The default is the last traced iteration: the first one includes warm-up and start-up waits. An iteration
    traced by two runs (a resumed run appends to the files) is drawn from the later run, rank by rank (each rank
    stamps "run" with its own start time, so the stamps of one run differ across ranks).
    """
    traced = sorted({e["iteration"] for e in events if "iteration" in e})
    if not traced:
        if iteration is not None:
            raise UsageError(f"--iteration {iteration}: this trace does not record iterations; drop the flag")
        return events, None
    pick = traced[-1] if iteration is None else iteration
    if pick not in traced:
        raise UsageError(f"--iteration {iteration}: not in the trace; traced iterations: "
                         f"{', '.join(map(str, traced))}")
    chosen = [e for e in events if e.get("iteration") == pick]
    latest = defaultdict(float)  # each rank stamps its own run start: the later run is a rank's own latest
    for e in chosen:
        latest[e["rank"]] = max(latest[e["rank"]], e.get("run", 0.0))
    return [e for e in chosen if e.get("run", 0.0) == latest[e["rank"]]], pick


def busy_time(intervals: list) -> float:
    """Length of the union of (start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def bubble_fractions(events: list) -> dict:
    """{rank: idle share of the global traced span [first start, last end]}."""
    t0, t1 = min(e["start"] for e in events), max(e["end"] for e in events)
    span = max(t1 - t0, 1e-12)
    by_rank = defaultdict(list)
    for e in events:
        by_rank[e["rank"]].append((e["start"], e["end"]))
    return {r: 1.0 - busy_time(iv) / span for r, iv in by_rank.items()}


def traced_schedule(events: list) -> PipelineSchedule:
    """The schedule a trace ran, from its shape (traces do not name it): the kind (engine.layout.SCHEDULE_KINDS)
    whose split backward matches the trace's W passes and whose chunks per rank match its chunks (zb-v: two with
    W passes, zb-h1: one; interleaved: several without, 1f1b: one)."""
    pp, chunks = len({e["pp_rank"] for e in events}), len({e["chunk"] for e in events})
    split = any(e["kind"] == "W" for e in events)
    name = next(n for n, kind in SCHEDULE_KINDS.items() if kind.split_backward == split
                and (kind.chunks == chunks if kind.chunks else chunks > 1))
    return PipelineSchedule.of(name, pp, chunks)


def mean_pass_seconds(events: list) -> dict:
    """{kind: mean duration of one traced pass of one chunk}: F, B and (split backwards) W."""
    by_kind = defaultdict(list)
    for e in events:
        by_kind[e["kind"]].append(e["end"] - e["start"])
    return {k: sum(v) / len(v) for k, v in by_kind.items()}


def ideal_bubble(events: list) -> float:
    """The mean idle share of the traced schedule with its passes at their mean traced durations and communication
    free: each rank's traced order replayed (`replayed`). For 1F1B with equal passes this is (p-1)/(m + p-1), for
    interleaving (p-1)/(v·m + p-1) (Narayanan et al. 2021, sec. 2.2); the zero-bubble schedules' own is lower
    (Qi et al. 2024), and that is what their trace is measured against."""
    bubbles = bubble_fractions(replayed(events))
    return sum(bubbles.values()) / len(bubbles)


def replayed(events: list) -> list:
    """The trace's events with each rank's traced order kept and its times replaced: every pass at its kind's
    mean traced duration, communication free (engine.pipeline.replay). What the schedule did, without the timing
    noise of a busy CPU, where a pass's measured time is mostly waiting for a core."""
    schedule = traced_schedule(events)
    rank_of = {e["pp_rank"]: e["rank"] for e in events}
    orders = [[(e["kind"], e["chunk"], e["microbatch"]) for e in sorted(events, key=lambda e: e["start"])
               if e["pp_rank"] == p] for p in range(schedule.pp)]
    times = replay(orders, schedule, mean_pass_seconds(events))
    return [dict(rank=rank_of[p], pp_rank=p, kind=kind, microbatch=mb, chunk=c, start=start, end=end)
            for (kind, p, c, mb), (start, end) in times.items()]


def _shade(colour: str, chunk: int, chunks: int) -> tuple:
    """Chunk 0 in the full colour, later chunks mixed towards white."""
    mix = 0.6 * chunk / max(chunks - 1, 1) if chunks > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in to_rgb(colour))


def plot(events: list, out: str, iteration=None, ideal=None, replayed_times: bool = False) -> None:
    t0 = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - t0
    scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    ranks = sorted({(e["pp_rank"], e["rank"]) for e in events})
    row = {rank: i for i, (_, rank) in enumerate(ranks)}
    chunks = len({e["chunk"] for e in events})
    bubbles = bubble_fractions(events)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, max(2.6, 1.2 + 0.45 * len(ranks))))
    px_per_unit = FIG_WIDTH_IN * DPI * 0.85 / max(span * scale, 1e-12)
    for e in events:
        x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        y = row[e["rank"]]
        colour = _shade(COLOURS.get(e["kind"], OTHER_COLOUR), e["chunk"], chunks)
        ax.add_patch(Rectangle((x, y - 0.4), w, 0.8, facecolor=colour, edgecolor="white", lw=0.5))
        label = str(e["microbatch"])
        if w * px_per_unit > CHAR_WIDTH_PX * (len(label) + 1):
            ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=8,
                    color="white" if e["chunk"] * 2 < chunks else "black")
    ax.set_xlim(0, span * scale)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} · pp {p}  ({100 * bubbles[r]:.0f}% idle)" for p, r in ranks], fontsize=9)
    ax.set_xlabel(f"time ({unit}) from the first event")
    mean_bubble = sum(bubbles.values()) / len(bubbles)
    micro = len({e["microbatch"] for e in events})
    which = f"iteration {iteration}: " if iteration is not None else ""
    name = traced_schedule(events).name
    ideal = ideal_bubble(events) if ideal is None else ideal
    timing = "replayed at mean pass times" if replayed_times else "measured (mean)"
    ax.set_title(f"{name}, {which}{len(ranks)} ranks, {micro} microbatches, {chunks} chunk(s) per rank — "
                 f"bubble {100 * mean_bubble:.1f}% {timing}, {100 * ideal:.1f}% ideal {name}", fontsize=10)
    split = any(e["kind"] == "W" for e in events)
    handles = [Patch(color=COLOURS["F"], label="forward"),
               Patch(color=COLOURS["B"], label="input gradient (B)" if split else "backward")]
    handles += [Patch(color=COLOURS["W"], label="weight gradient (W)")] if split else []
    handles += [Patch(color=_shade(OTHER_COLOUR, c, chunks), label=f"chunk {c} (shade)")
                for c in range(chunks)] if chunks > 1 else []
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=9, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", metavar="TRACE", help="trace file, directory, or prefix of TRACE.rank{R}.jsonl files")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--iteration", type=int, help="iteration to draw when the trace records them (default: last)")
    p.add_argument("--replay", action="store_true",
                   help="draw each rank's traced order with every pass at its kind's mean time and communication "
                        "free: the schedule's shape without timing noise (for traces from a busy CPU)")
    args = p.parse_args(argv)
    try:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise UsageError(f"--out {args.out}: directory {out_dir} does not exist; create it first")
        events, iteration = select_iteration(load_events(trace_files(args.trace)), args.iteration)
    except UsageError as e:
        print(f"plot_pipeline.py: error: {e}", file=sys.stderr)
        return 2
    ideal = ideal_bubble(events)
    drawn = replayed(events) if args.replay else events
    plot(drawn, args.out, iteration, ideal, args.replay)
    bubbles = bubble_fractions(drawn)
    mean = sum(bubbles.values()) / len(bubbles)
    print(f"wrote {args.out} ({len(events)} passes on {len(bubbles)} ranks, {traced_schedule(events).name}, "
          f"mean bubble {100 * mean:.1f}%{' replayed' if args.replay else ''}, ideal {100 * ideal:.1f}%)")
    if not args.replay and mean > ideal + NOISY_EXCESS:
        print(f"the measured bubble is {100 * (mean - ideal):.0f} points above the ideal: on a shared CPU most of "
              "that is waiting for a core; --replay draws the traced order without it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

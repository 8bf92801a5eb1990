"""What a section is handed: the run's options, its clock, and the record it fills.

A section runs in a forked child that the runner may kill at its time limit, so `Record` rewrites the
section's JSON file after every figure: whatever was measured before a kill or a crash survives. Every figure
is printed as it is taken, with its anchor beside it, and flushed (the lease returns only the output's tail,
and PYTHONUNBUFFERED may be unset).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

OUT_OF_TIME = "out of time budget"
NEEDS_CUDA = "skipped: needs CUDA"


@dataclass(frozen=True)
class Options:
    device: str      # "cuda" or "cpu"
    quick: bool
    dry_run: bool
    out: str
    started: float   # time.time() when the whole check began (progress lines show seconds since)
    models: tuple = ()  # the training section's models, in order (--models); () every one

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def mode(self) -> str:
        return "dry-run" if self.dry_run else "quick" if self.quick else "full"

    def pick(self, full, quick, dry):
        """The size for this mode: dry-run sizes are tiny on any device, quick ones trimmed."""
        return dry if self.dry_run else quick if self.quick else full


def say(opts: Options, text: str) -> None:
    print(f"[gpu-check +{time.time() - opts.started:6.1f}s] {text}", flush=True)


class Record:
    """One section's findings: figures (value, unit, anchor), tables of rows, skips with their reason."""

    def __init__(self, name: str, path: str, opts: Options, deadline: float):
        self.name, self.path, self.opts, self.deadline = name, path, opts, deadline
        self.data = {"figures": {}, "tables": {}, "skipped": {}, "notes": []}
        self._flush()

    def left(self) -> float:
        """Seconds until this section should stop starting new work."""
        return self.deadline - time.time()

    def has_time(self, what: str, need: float) -> bool:
        """Whether `need` seconds remain for `what`; if not, `what` is recorded as skipped for time."""
        if self.left() >= need:
            return True
        self.skip(what, f"{OUT_OF_TIME} ({self.left():.0f} s left, needs ~{need:.0f} s)")
        return False

    def figure(self, key: str, value, unit: str, anchor: str = "", note: str = "") -> None:
        self.data["figures"][key] = {"value": value, "unit": unit, "anchor": anchor, "note": note}
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        say(self.opts, f"{self.name}: {key} = {shown} {unit}" + (f"  (anchor {anchor})" if anchor else "")
            + (f"  [{note}]" if note else ""))
        self._flush()

    def row(self, table: str, row: dict, line: str = "") -> None:
        self.data["tables"].setdefault(table, []).append(row)
        if line:
            say(self.opts, f"{self.name}: {line}")
        self._flush()

    def skip(self, what: str, reason: str) -> None:
        self.data["skipped"][what] = reason
        say(self.opts, f"{self.name}: {what}: {reason}")
        self._flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self._flush()

    def fail(self, error: str) -> None:
        self.data["error"] = error
        self._flush()

    def _flush(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, default=_plain)
        os.replace(tmp, self.path)


def _plain(value):
    """JSON for what json does not know: numpy and torch scalars as numbers, anything else as its text."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)

"""A committed gpu-check result's table put where the docs show it, as tests/test_gpu_check.py requires: the README's
"Measured on GPU" shows the newest run of each card, docs/evidence.md every run.

    python -m benchmarks.gpu.publish benchmarks/results/gpu-<card>-<date>.json

README.md: the table of an older run of the same card is replaced by this one's; a card not shown yet gets its
table after the section's last one; a run older than the one shown changes nothing there. docs/evidence.md: unless
the table is there already, it goes first under "### Measured on GPU" (after the section's opening paragraph),
below a line naming the card, the date, the software and each run's commit and command. What the run found is
for its author to write under that line. Prints what it changed; a second call changes nothing.

Why a tool: a lease's session has minutes left after its runs, and a table edited by hand is one the test rejects.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.gpu.report import readme_table

HEADER = "| card | date | what |"
SECTION = {"README.md": "## Measured on GPU", "docs/evidence.md": "### Measured on GPU"}


def tables(lines: list, start: int) -> list:
    """(first, end) line indexes of each results table in the section that begins at line `start` (to the next
    heading of the same or a higher level)."""
    level = lines[start].split(" ")[0]
    out, i = [], start + 1
    while i < len(lines) and not (lines[i].startswith("#") and lines[i].split(" ")[0] <= level):
        if lines[i].startswith(HEADER):
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            out.append((i, end))
            i = end
        else:
            i += 1
    return out


def section_start(lines: list, doc: str) -> int:
    try:
        return lines.index(SECTION[doc])
    except ValueError:
        raise ValueError(f"{doc}: no '{SECTION[doc]}' heading to put the table under") from None


def card_and_date(lines: list, span: tuple) -> tuple:
    """The card and date of a table's first row."""
    cells = [c.strip() for c in lines[span[0] + 2].strip("|").split("|")]
    return cells[0], cells[1]


def into_readme(text: str, result: dict) -> tuple:
    """(the README with this result's table as its card's, what changed or None)."""
    lines = text.split("\n")
    start = section_start(lines, "README.md")
    table = readme_table(result).rstrip("\n").split("\n")
    spans = tables(lines, start)
    if not spans:
        raise ValueError(f"README.md: no results table under '{SECTION['README.md']}' to place the new one beside")
    shown = [s for s in spans if card_and_date(lines, s)[0] == result["card"]]
    if shown:
        first, end = shown[0]
        date = card_and_date(lines, shown[0])[1]
        if lines[first:end] == table or date > result["date"]:
            return text, None
        lines[first:end] = table
        return "\n".join(lines), f"README.md: {result['card']}'s table of {date} replaced by {result['date']}'s"
    end = spans[-1][1]
    lines[end:end] = ["", "", *table]
    return "\n".join(lines), f"README.md: {result['card']}'s table added ({result['date']})"


def heading(result: dict) -> str:
    """docs/evidence.md's line above a run's table: card, date, software, and how it was made."""
    fig = {k: v.get("value") for k, v in result["sections"].get("card", {}).get("figures", {}).items()}
    software = ", ".join(f"{what} {fig[key]}" for what, key in (("driver", "driver"), ("torch", "torch_version"),
                                                               ("triton", "triton_version"),
                                                               ("transformers", "transformers_version"))
                         if fig.get(key))
    runs = result.get("runs") or [{"run": 1, "commit": "unrecorded", "command": result["command"]}]
    made = "; ".join(f"run {r['run']} at commit {r['commit']}: `{r['command']}`" for r in runs)
    return f"**{result['card']}, {result['date']}** ({software}). {made}."


def into_evidence(text: str, result: dict) -> tuple:
    """(docs/evidence.md with this result's table first under its heading, what changed or None)."""
    table = readme_table(result)
    if table in text:
        return text, None
    lines = text.split("\n")
    start = section_start(lines, "docs/evidence.md")
    at = start + 1
    while at < len(lines) and lines[at].strip():  # the section's opening paragraph stays first
        at += 1
    lines[at:at] = ["", heading(result), "", *table.rstrip("\n").split("\n")]
    return "\n".join(lines), f"docs/evidence.md: {result['card']}'s table of {result['date']} added; write what it " \
                             "found under its heading"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu/publish.py", description=__doc__.split("\n\n")[0])
    p.add_argument("result", metavar="RESULT.json", help="a results file, benchmarks/results/gpu-<card>-<date>.json")
    p.add_argument("--readme", default="README.md")
    p.add_argument("--evidence", default="docs/evidence.md")
    args = p.parse_args(argv)
    try:
        with open(args.result) as f:
            result = json.load(f)
        docs = {}
        for path, place in ((args.readme, into_readme), (args.evidence, into_evidence)):
            with open(path) as f:
                docs[path] = place(f.read(), result)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"benchmarks/gpu/publish.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for path, (text, change) in docs.items():
        if change:
            with open(path, "w") as f:
                f.write(text)
        print(change or f"{path}: already shows it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

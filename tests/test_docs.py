"""The README and docs/: the quick start comes first with the two commands and their times, every relative link
and anchor resolves, and no internal wording is left. Five pages are written beside this one and may be absent
from a checkout until they are merged; a link to any other missing file fails."""
import os
import re

from planner_common import ROOT

PAGES_WRITTEN_ELSEWHERE = {"docs/from-megatron.md", "docs/fp8.md", "docs/deepseek-v3.md", "docs/operations.md",
                           "docs/moe-routing.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md"] + docs


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _anchors(text):
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_quick_start_comes_first_with_both_commands_and_their_times():
    readme = _read("README.md")
    first = readme.index("## ")
    assert readme[first:].startswith("## Quick start")
    block = readme[readme.index("```bash", first):]
    block = block[:block.index("```", 3)]
    assert block.index("venv") < block.index("make demo") < block.index("make test") < block.index("make test-fast")
    timed = [line for line in block.splitlines() if line.startswith("make test")]
    assert len(timed) == 2 and all(re.search(r"about \d+ minutes", line) for line in timed), timed  # both timed
    assert "--data-path" in readme[first:readme.index("## How-tos")]  # a first real-data run, in the quick start


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(_read(page)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, rel)):
                if rel not in PAGES_WRITTEN_ELSEWHERE:
                    broken.append(f"{page}: {target}")
                continue
            if anchor and rel.endswith(".md") and anchor not in _anchors(_read(rel)):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken


def test_no_internal_wording():
    found = []
    for page in _pages():
        text = _read(page).lower()
        for phrase in ("beyond the contract", "shared contract", "in any session", "was lent", "lent to a session"):
            if phrase in text:
                found.append(f"{page}: {phrase}")
        found += [f"{page}: {m}" for m in re.findall(r"\bissue \d+", text)]
    assert not found, found


def test_the_planner_page_holds_the_calibration_table_as_the_planner_computes_it():
    """docs/planner.md's published-runs table is engine.planner.published.markdown_table() row for row, so the
    errors it states are the planner's own."""
    from engine.planner.published import markdown_table
    page = _read("docs/planner.md")
    missing = [row for row in markdown_table().splitlines()[2:] if row not in page]
    assert not missing, missing

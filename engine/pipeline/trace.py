"""The pipeline trace (--pipeline-trace FILE): every forward and backward a rank runs, with its clock.

Kinds are "F" and "B", plus "W" under a zero-bubble schedule, whose "B" is then the input gradient only.

`PipelineRunner` records each operation as it finishes; a record's start is when the operation's inputs
had arrived, so time spent waiting for a neighbour shows as idle. Each rank writes its own JSON-lines
file, FILE.rank<N>.jsonl, which tools/plot_pipeline.py draws as a timeline.
"""
from __future__ import annotations

import json
import os


class PipelineTrace:
    def __init__(self, rank: int, pp_rank: int):
        self.rank, self.pp_rank = rank, pp_rank
        self.iteration = 0  # set by the trainer before each step
        self.events: list = []

    def record(self, kind: str, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.events.append({"iteration": self.iteration, "rank": self.rank, "pp_rank": self.pp_rank, "kind": kind,
                            "microbatch": microbatch, "chunk": chunk, "start": start, "end": end})

    def write(self, prefix: str) -> str:
        path = f"{prefix}.rank{self.rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.writelines(json.dumps(event) + "\n" for event in self.events)
        return path

"""The pipeline trace (--pipeline-trace FILE): every forward and backward a rank runs, with its clock.

Kinds are "F" and "B", plus "W" under a zero-bubble schedule, whose "B" is then the input gradient only.

`PipelineRunner` records each operation as it finishes; a record's start is when the operation's inputs
had arrived, so time spent waiting for a neighbour shows as idle. Each rank appends to its own JSON-lines
file, FILE.rank<N>.jsonl, which tools/plot_pipeline.py draws as a timeline: a resumed run adds its events
after the earlier run's, each stamped with when its run started (`run`), so an iteration both ran is drawn
from the later run.
"""
from __future__ import annotations

import json
import os
import time


class PipelineTrace:
    def __init__(self, rank: int, pp_rank: int):
        self.rank, self.pp_rank = rank, pp_rank
        self.iteration = 0  # set by the trainer before each step
        self.events: list = []
        self.run = time.time()

    def record(self, kind: str, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.events.append({"iteration": self.iteration, "rank": self.rank, "pp_rank": self.pp_rank, "kind": kind,
                            "microbatch": microbatch, "chunk": chunk, "start": start, "end": end, "run": self.run})

    def write(self, prefix: str) -> str:
        path = f"{prefix}.rank{self.rank}.jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as fh:
            fh.writelines(json.dumps(event) + "\n" for event in self.events)
        return path

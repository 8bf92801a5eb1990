"""What the run is doing right now, and which process groups that involves.

The launcher prints it when a collective fails (a dead or stuck peer), so the one error line says where
the job was: `with phase("optimizer step of iteration 7", "dp"):` reads "optimizer step of iteration 7
(dp group [0, 2])" while the block runs. If the block raises, the text stays: it is where the run failed.
"""
from __future__ import annotations

import contextlib


class Phase:
    def __init__(self, ctx, text: str = "starting"):
        self.ctx, self.text = ctx, text

    def __str__(self) -> str:
        return self.text

    @contextlib.contextmanager
    def __call__(self, what: str, *groups: str):
        """`groups`: kinds of process group the work talks to ("tp", "pp", "dp"), or "all" for every rank."""
        previous = self.text
        self.text = what + (f" ({', '.join(map(self._describe, groups))})" if groups else "")
        yield
        self.text = previous

    def _describe(self, kind: str) -> str:
        return "all ranks" if kind == "all" else f"{kind} group {getattr(self.ctx, kind + '_ranks')}"

    def group_of(self, op: str, ranks) -> str:
        """The last collective as words: 'all_to_all over the ep group [0, 1]' (its kind when it is one of this
        rank's groups), 'send/recv with rank 2' for a point-to-point exchange."""
        if ranks is None:
            return op
        me = getattr(self.ctx, "rank", None)
        if op == "send/recv":
            peers = [r for r in ranks if r != me]
            kind = next((k + " " for k in ("pp", "cp", "tp", "dp", "ep")
                         if set(ranks) <= set(getattr(self.ctx, k + "_ranks", None) or [])), "")
            return f"{kind}send/recv with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
        for kind in ("tp", "cp", "dp", "dp_cp", "ep", "pp"):
            if list(getattr(self.ctx, kind + "_ranks", None) or []) == list(ranks):
                return f"{op} over the {kind} group {list(ranks)}"
        return f"{op} over ranks {list(ranks)}"

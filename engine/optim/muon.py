"""Muon (`--optimizer muon`): momentum orthogonalised by a Newton-Schulz iteration, for the hidden layers' weight
matrices; the Optimizer (engine/optim/optimizer.py) gives every other parameter to the scalar optimizer, AdamW.

Per step, on this rank's range of each matrix (all of it, or its dp x cp shard under the distributed
optimizer, exactly the range AdamW would update): the momentum, an exponential moving average of the
(unscaled, clipped) gradients, m <- mu m + (1 - mu) g; the look-ahead u = m, or with --muon-nesterov
g + mu (m - g); the whole matrix of u orthogonalised where the plan says (engine/optim/muon_plan.py) and the
scaled result O brought back; then, decoupled, w <- w (1 - lr wd) - lr O. This is torch.optim.Muon's and
Megatron-Core's algorithm (tests/test_muon.py compares with torch's in fp32). The momentum is the only state:
4 bytes per element of the range, fp32, kept per parameter name and range like Adam's moments, so checkpoints
reshard it at any layout.

Nothing silent: `classify` says for every trainable parameter whether Muon takes it or why the scalar
optimizer does (the start-up banner lists those), and a Muon run takes Muon for every marked matrix.
"""
from __future__ import annotations

import math

import torch

from engine.optim.muon_plan import MuonPlan
from engine.optim.newton_schulz import MuonSettings
from engine.parallel.layers import is_vocabulary_table, spec_of


class Muon:
    def __init__(self, settings: MuonSettings, entries: list, buffers: list, ctx):
        """`entries`: the Optimizer's entries (this rank's ranges) of the parameters Muon takes; `buffers`: the
        grad buffers holding them (each has its plan)."""
        self.settings, self.entries = settings, entries
        self.momenta = [torch.zeros_like(e.master) for e in entries]
        self._of_master = {id(e.master): m for e, m in zip(entries, self.momenta)}
        self.plans = [MuonPlan(b, ctx, settings) for b in buffers]

    def momentum(self, master: torch.Tensor) -> torch.Tensor:
        """The momentum of the entry whose master (or fp32 weight range) is `master`."""
        return self._of_master[id(master)]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        s = self.settings
        looks, updates = {}, {}
        for e, m in zip(self.entries, self.momenta):
            g = e.master.grad
            m.lerp_(g, 1 - s.momentum)
            looks[id(e.param)] = (e.start, g.lerp(m, s.momentum) if s.nesterov else m)
            updates[id(e.param)] = (e.start, torch.empty_like(e.master))
        for plan in self.plans:
            plan.run(looks, updates)
        for e in self.entries:
            e.master.mul_(1 - lr * s.weight_decay)
            e.master.add_(updates[id(e.param)][1], alpha=-lr)

    def flops(self) -> int:
        """Newton-Schulz FLOPs this rank runs per step."""
        return sum(plan.flops() for plan in self.plans)

    def bytes_sent(self) -> float:
        """Bytes this rank sends per step to bring matrices whole and their updates back."""
        return sum(plan.bytes_sent() for plan in self.plans)


def classify(name: str, p) -> str:
    """"" when Muon takes parameter `p`, else why the scalar optimizer does."""
    spec = spec_of(p)
    if spec.matrix:
        return ""
    if p.dim() < 2:
        return "1-D"
    if is_vocabulary_table(p):
        return "a vocabulary table (embedding or output layer)"
    return "2-D but no hidden layer's weight (a position table or a router)"


def summary(named: list, settings: MuonSettings) -> list:
    """Banner lines from (name, full shape, classify's reason) of every trainable parameter (each once): what
    Muon takes, with its settings, and every parameter the scalar optimizer takes, grouped by reason and by
    name with layer numbers as *."""
    muon = [(n, s) for n, s, why in named if not why]
    lines = [f"optimizer: muon on the {len(muon)} weights of the hidden layers ({sum(math.prod(s) for _, s in muon):,} "
             f"parameters; {settings.describe()}); AdamW (--muon-scalar-optimizer adam) on the rest:"]
    by_reason: dict = {}
    for n, s, why in named:
        if why:
            key = ".".join("*" if part.isdigit() else part for part in n.split("."))
            by_reason.setdefault(why, {}).setdefault((key, tuple(s)), []).append(n)
    for why, names in by_reason.items():
        listed = ", ".join(f"{key} {list(shape)}" + (f" x{len(ns)}" if len(ns) > 1 else "")
                           for (key, shape), ns in names.items())
        lines.append(f"  {why}: {listed}")
    return lines

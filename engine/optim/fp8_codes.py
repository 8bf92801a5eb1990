"""How one weight gathered by `--fp8-param-gather` becomes FP8 codes on its replica and, once gathered, its layer's
forward operand: the part of engine/optim/fp8_gather.py and fp8_shard.py that depends on what the weight is.

Two kinds of weight, each quantized exactly as its layer would quantize the whole weight itself:

- `LinearCodes`: a column- or row-parallel linear's weight (engine.fp8.linear, `Fp8Linear`): one scale, the one
  its weight `Scaler` would take (current scaling's from the whole weight's amax, under tp x cp over the ranks
  holding its parts; under delayed scaling the history's), handed over as a `Gathered`.
- `ExpertCodes`: a stack of routed experts' weights [E, K, N] (engine.fp8.experts, `Fp8Experts`): one scale per
  expert from the amax of that expert's whole weight (whatever the recipe: the experts' weights take their
  current amax even under delayed scaling), handed over as a `GatheredExperts`. The experts are whole on every
  tp rank, so their amaxes are reduced over the replicas only.

A replica holds a flat range [lo, hi) of the weight's elements (its shard, maybe none). Each kind gives: the
amaxes of its shard (`amaxes`, `count` of them: 1, or E, an expert spanning no element of the shard counting
0), the group beyond the replicas that they must be reduced over (`group`), the scales of the reduced amaxes,
the shard's codes (`encode`), and the hand-over of the whole weight's codes to its layer, with what says
whether they still hold (`holds`, `refreshed`). MAX is exact and a scale depends on the weight only through
its amax, so the shards' codes are the whole weight's codes, bit for bit.
"""
from __future__ import annotations

import math

import torch

from engine.fp8.experts import Fp8Experts, GatheredExperts, single_tile
from engine.fp8.linear import Fp8Linear, Gathered
from engine.fp8.quantize import Quantized, amax, cast, fp8_dtype, quantize


class LinearCodes:
    """A tensor-scaled FP8 linear's weight: one scale, its weight Scaler's."""

    count = 1

    def __init__(self, lin: Fp8Linear):
        self.lin = lin

    @property
    def dtype(self):
        return self.lin.weight.dtype

    @property
    def steps(self) -> int:
        """The scaler's step count (a delayed history's pushes): codes hold while it does."""
        return self.lin.weight.steps

    @property
    def group(self):
        """Current scaling reduces a tp-split weight's amax over tp x cp too; a delayed scale needs no amax."""
        return None if self.lin.weight.from_history else self.lin.group

    def amaxes(self, shard: torch.Tensor, lo: int) -> torch.Tensor:
        return amax(shard).reshape(1)

    def scales(self, now: torch.Tensor) -> torch.Tensor:
        return self.lin.weight.encode_scale(now.reshape(()))

    def encode(self, shard: torch.Tensor, lo: int, scale: torch.Tensor) -> torch.Tensor:
        """`shard`'s FP8 codes under `scale`, as bytes."""
        return quantize(shard, scale, self.dtype).data.view(torch.uint8)

    def hand_over(self, p, codes: torch.Tensor, now, scale, steps: int, whole: bool) -> None:
        """Give the linear the whole weight `p`'s codes (bytes, flat) as its forward operand, holding while p's
        version and the scaler's step count `steps` do; `whole`: p's own values are whole too."""
        data = codes.view(self.dtype).view(-1, p.shape[-1])
        self.lin.gathered = Gathered(Quantized(data, scale.float().reshape(()).reciprocal()), now.reshape(()),
                                     p._version, steps, whole=whole)

    def holds(self, p) -> bool:
        g = self.lin.gathered
        return g is not None and g.version == p._version

    def refreshed(self, p) -> None:
        """p was gathered whole in the run's precision (its version moved, its values did not)."""
        self.lin.gathered.version, self.lin.gathered.whole = p._version, True


class ExpertCodes:
    """A stacked routed-expert weight [E, K, N]: one scale per expert, from its current amax."""

    steps = 0  # no history moves the experts' scales
    group = None  # whole on every tp rank: the replicas' MAX is the whole amax

    def __init__(self, experts: Fp8Experts, p):
        self.experts, self.shape = experts, tuple(p.shape)
        self.count, self.per = self.shape[0], math.prod(self.shape[1:])
        self.dtype = fp8_dtype(experts.recipe.fmt, False)

    def _runs(self, shard: torch.Tensor, lo: int) -> list:
        """(first expert, rows [experts, elements]) covering the flat elements [lo, lo + len(shard)): the part of
        an expert the shard begins in, the whole experts it holds, the part of one it ends in."""
        out, at, n = [], 0, shard.numel()
        while at < n:
            e, within = divmod(lo + at, self.per)
            if within or n - at < self.per:  # a part of expert e
                take = min(self.per - within, n - at)
                out.append((e, shard[at:at + take].view(1, take)))
            else:  # whole experts e, e+1, ...
                take = (n - at) // self.per * self.per
                out.append((e, shard[at:at + take].view(-1, self.per)))
            at += take
        return out

    def amaxes(self, shard: torch.Tensor, lo: int) -> torch.Tensor:
        """This shard's amax of each expert (0 for those it holds no element of)."""
        out = torch.zeros(self.count, device=shard.device)
        for e, rows in self._runs(shard, lo):
            out[e:e + rows.shape[0]] = rows.detach().abs().amax(dim=1).float()
        return out

    def scales(self, now: torch.Tensor) -> torch.Tensor:
        return self.experts.encode_scales(now)

    def encode(self, shard: torch.Tensor, lo: int, scale: torch.Tensor) -> torch.Tensor:
        """`shard`'s FP8 codes, each element under its expert's scale, as bytes."""
        parts = [cast(rows, scale[e:e + rows.shape[0]].reshape(-1, 1), self.dtype).view(-1)
                 for e, rows in self._runs(shard, lo)]
        codes = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=shard.device)
        return codes.view(torch.uint8)

    def hand_over(self, p, codes: torch.Tensor, now, scale, steps: int, whole: bool) -> None:
        """Give the experts the whole weight `p`'s codes (bytes, flat) as their forward operands, holding while p's
        version does (`whole` changes nothing: no moved scale can make them stale)."""
        data = codes.view(self.dtype).view(self.shape)
        tile_of = single_tile(*self.shape[1:], device=codes.device)
        self.experts.gathered[id(p)] = GatheredExperts(
            [self.experts.operand(data[i], scale[i], tile_of) for i in range(self.count)], p._version)

    def holds(self, p) -> bool:
        g = self.experts.gathered.get(id(p))
        return g is not None and g.version == p._version

    def refreshed(self, p) -> None:
        self.experts.gathered[id(p)].version = p._version


def fp8_weights(model_chunks: list) -> dict:
    """id(weight) -> how its gathers make its FP8 codes: the chunks' column- and row-parallel FP8 linears'
    weights and their routed experts' stacked weights."""
    out = {}
    for chunk in model_chunks:
        for m in chunk.modules():
            fp8 = getattr(m, "fp8", None)
            if isinstance(fp8, Fp8Linear):
                out[id(m.weight)] = LinearCodes(fp8)
            elif isinstance(fp8, Fp8Experts):
                for p in (m.fc1, m.fc2):
                    out[id(p)] = ExpertCodes(fp8, p)
    return out

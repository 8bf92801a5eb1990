"""How one Hugging Face tensor comes from one of ours, as objects: `out` makes the HF tensor from ours (export),
`into` puts it back where it came from (import), `out_shape` is what `out` gives for a shape. A family's plan
pairs every HF tensor name with our tensor's name and one of these.

`out` makes one copy at most besides a transpose, so peak memory stays near two copies of the tensor.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch

from engine.config import ConfigError


class Transform(abc.ABC):
    """One HF tensor's relation to ours; subclasses say how it goes each way."""

    @abc.abstractmethod
    def out(self, t: torch.Tensor) -> torch.Tensor:
        """The HF tensor made from ours."""

    @abc.abstractmethod
    def into(self, full: torch.Tensor, t: torch.Tensor) -> None:
        """Put the HF tensor `t` where `out` took it from in our (unpadded) tensor `full`."""

    def out_shape(self, shape: tuple) -> tuple:
        return tuple(self.out(torch.empty(shape, device="meta")).shape)


class Whole(Transform):
    """The tensor as it is."""

    def out(self, t):
        return t

    def into(self, full, t):
        full.copy_(t)


WHOLE = Whole()


class Transposed(Transform):
    """[in, out] for [out, in]: GPT-2's Conv1D weights."""

    def out(self, t):
        return t.t().contiguous()

    def into(self, full, t):
        full.copy_(t.t())


@dataclass(frozen=True)
class Part(Transform):
    """One of the tensors stacked along our first dimension: SwiGLU's gate (0) and up (1) projections in fc1."""
    index: int

    def out(self, t):
        return t[self.index]

    def into(self, full, t):
        full[self.index].copy_(t)


@dataclass(frozen=True)
class QKV(Transform):
    """Rows of our fused QKV, which is group-interleaved ([g: q heads, k, v] per query group): q, k or v (part
    0, 1, 2), or all three in turn (part None), transposed for a Conv1D. Query head g*P+j then uses k/v head g,
    the order transformers' grouped-query attention expects."""
    groups: int
    per_group: int
    head_dim: int
    part: Optional[int] = None
    transposed: bool = False

    @classmethod
    def of(cls, m, part: Optional[int] = None, transposed: bool = False) -> "QKV":
        groups = m.resolved_query_groups()
        return cls(groups, m.num_attention_heads // groups, m.head_dim(), part, transposed)

    def rows(self) -> torch.Tensor:
        per, d = self.per_group, self.head_dim
        rows = torch.arange(self.groups * (per + 2) * d).view(self.groups, per + 2, d)
        q, k, v = rows[:, :per].reshape(-1), rows[:, per].reshape(-1), rows[:, per + 1].reshape(-1)
        return torch.cat((q, k, v)) if self.part is None else (q, k, v)[self.part]

    def out(self, t):
        picked = t.index_select(0, self.rows().to(t.device))
        return picked.t().contiguous() if self.transposed else picked

    def into(self, full, t):
        full.index_copy_(0, self.rows().to(full.device), t.t() if self.transposed else t)


@dataclass(frozen=True)
class ExpertIn(Transform):
    """Expert e's gate (part 0) or up (part 1) projection as a Linear weight [F, h], from our fc1 [E, h, 2F]."""
    expert: int
    part: int
    width: int  # F

    def _columns(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.expert][:, self.part * self.width:(self.part + 1) * self.width]

    def out(self, t):
        return self._columns(t).t()

    def into(self, full, t):
        self._columns(full).copy_(t.t())


@dataclass(frozen=True)
class ExpertOut(Transform):
    """Expert e's down projection as a Linear weight [h, F], from our fc2 [E, F, h]."""
    expert: int

    def out(self, t):
        return t[self.expert].t()

    def into(self, full, t):
        full[self.expert].copy_(t.t())


class Doubled(Transform):
    """Twice ours: exact both ways, a power of two."""

    def out(self, t):
        return t * 2

    def into(self, full, t):
        full.copy_(t / 2)


class _Zeros(Transform):
    """A tensor Ternion has no counterpart of, written as zeros; import accepts only zeros."""
    what = ""

    def into(self, full, t):
        if t.any():
            raise ConfigError(f"a {self.what} is not zero: Ternion has no such tensor")


class ZeroGate(_Zeros):
    """A [1, h] gate of zeros, from the router weight [E, h]."""
    what = "shared expert gate"

    def out(self, t):
        return t.new_zeros((1, t.shape[-1]))


@dataclass(frozen=True)
class ZeroBias(_Zeros):
    """A bias of `size` zeros, from the weight it belongs to."""
    size: int
    what = "bias"

    def out(self, t):
        return t.new_zeros(self.size)


@dataclass(frozen=True)
class InterleavedRope(Transform):
    """Rows of a projection whose blocks of `width` rows end in `rope` RoPE rows, rotated in interleaved pairs
    (rows 2i and 2i+1 of the RoPE part: DeepSeek's checkpoints, and megatron-core's MLA, which de-interleaves them
    before rotating) from Ternion's halves (our rows i and i + rope/2), the rest as they are. The same
    permutation on q's and k's RoPE rows leaves every dot product as it was."""
    width: int
    rope: int

    def rows(self, total: int) -> torch.Tensor:
        half = self.rope // 2
        order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
        block = torch.cat((torch.arange(self.width - self.rope), self.width - self.rope + order))
        starts = torch.arange(0, total, self.width)
        return (starts[:, None] + block[None, :]).reshape(-1)

    def out(self, t):
        return t.index_select(0, self.rows(t.shape[0]).to(t.device))

    def into(self, full, t):
        full.index_copy_(0, self.rows(full.shape[0]).to(full.device), t)

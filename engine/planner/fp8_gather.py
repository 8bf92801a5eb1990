"""`--fp8-param-gather`'s bytes (engine/optim/fp8_gather.py), replayed on the planner's bucket layout
(engine/planner/sharding.py): what the distributed optimizer's all-gathers produce in a step, and what the
engine keeps for them between steps.

Under ZeRO-1/2 (`optim`, `optim_grads`) with a tensor-scaled recipe (tensorwise, delayed), each bucket of the
dense grad buffer that holds FP8 linears' weights (params.Tensor.fp8: the column- and row-parallel linears; not
the routed experts, which fill a buffer of their own, nor MLA's or MTP's replicated projections, the
embeddings, the output layer or the norms) is all-gathered as one payload of bytes per replica. A payload holds
that replica's elements of the bucket: the other parameters' in the run's precision, the FP8 weights' one byte
each. Every payload is as long as the bucket's longest, rounded up to a whole element of the run's precision.
Replica r holds elements [r P/n, (r+1) P/n) of a bucket padded to P over n replicas (its padding in no
payload), so the FP8 spans of each bucket give every payload exactly. A bucket without FP8 weights is gathered
as without the flag: P elements in the run's precision. ZeRO-3's unit gathers, which the engine moves the same
way (engine/optim/fp8_shard.py), are not priced here: the planner prices them as without the flag.

Kept between steps, beside the weights (which stay in the run's precision, whole): every FP8 weight's codes,
one byte an element of the whole weight on this rank, and each such bucket's gathered payloads (n of them),
allocated at its first gather.

Before the gathers the step all-reduces (MAX) one fp32 amax per FP8 weight over the replicas and, under
tensorwise (current) scaling at tp x cp > 1, over those ranks too: a vector of a few hundred floats each,
latency-bound (step_time prices them so).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from engine.config import ModelConfig
from engine.layout import Layout
from engine.planner.params import PARAM_BYTES
from engine.planner.sharding import rank_chunks


class Fp8GatherBytes(NamedTuple):
    """Pipeline rank's --fp8-param-gather bytes (each data-parallel replica has the same)."""
    gathered: int  # what the step's all-gathers of the dense buffer produce (one replica: none run, none priced)
    payloads: int  # the payloads of the buckets holding FP8 weights, kept between steps
    codes: int     # the FP8 weights' codes, one byte an element, kept between steps
    weights: int   # FP8 weights: the amax all-reduce carries one fp32 for each


def fp8_gather_bytes(model: ModelConfig, layout: Layout, precision: str, rank: int,
                     bucket_numel: Optional[int] = None) -> Fp8GatherBytes:
    """The bytes of pipeline rank `rank` under ZeRO-1/2 with --fp8-param-gather (see the module doc); the
    expert buffer holds no FP8 weights and gathers as without the flag."""
    n, size = layout.shard_group, PARAM_BYTES[precision]
    gathered = payloads = codes = weights = 0
    for chunk in rank_chunks(model, layout, rank, False, bucket_numel):
        for (used, padded), spans in zip(chunk.buckets, chunk.fp8):
            if not spans:
                gathered += padded * size
                continue
            payload = n * _longest_payload(used, padded // n, spans, size)
            gathered, payloads = gathered + payload, payloads + payload
            codes += sum(hi - lo for lo, hi in spans)
            weights += len(spans)
    return Fp8GatherBytes(gathered, payloads, codes, weights)


def _longest_payload(used: int, share: int, spans: tuple, size: int) -> int:
    """Bytes of a bucket's longest replica payload, rounded up to whole elements of `size` bytes: replica r
    holds elements [r share, (r+1) share) of the bucket's `used` ones, one byte each within `spans` (the FP8
    weights'), `size` bytes each outside. Only the replicas that hold other parameters' elements are visited."""
    others: dict = {}  # replica -> its elements outside the spans
    at = 0
    for lo, hi in list(spans) + [(used, used)]:
        for r in range(at // share, -(-lo // share)):  # the elements [at, lo) are not FP8
            others[r] = others.get(r, 0) + min(lo, (r + 1) * share) - max(at, r * share)
        at = hi
    held = lambda r: max(0, min(used, (r + 1) * share) - r * share)  # noqa: E731
    # of the replicas holding FP8 elements only, the first holds the most
    alone = next((r for r in range(used // share + 1) if r not in others), None)
    longest = max([held(r) + (size - 1) * k for r, k in others.items()] + [held(alone) if alone is not None else 0])
    return -(-longest // size) * size

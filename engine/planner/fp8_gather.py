"""`--fp8-param-gather`'s bytes (engine/optim/fp8_gather.py, fp8_shard.py), replayed on the planner's bucket
layout (engine/planner/sharding.py): what the sharded weights' all-gathers produce, what the engine keeps for
them between steps and, under ZeRO-3, what its unit gathers hold while in flight.

With a tensor-scaled recipe (tensorwise, delayed), each bucket that holds FP8 weights (params.Tensor.fp8: in the
dense grad buffer the column- and row-parallel linears', not MLA's or MTP's replicated projections, the
embeddings, the output layer or the norms; in the experts' own buffer the routed experts' stacked weights, over
their dp/ep x cp replicas) is all-gathered as one payload of bytes per replica. A payload holds that replica's
elements of the bucket: the other parameters' in the run's precision, the FP8 weights' one byte each. Every
payload is as long as the bucket's longest, rounded up to a whole element of the run's precision. Replica r holds
elements [r P/n, (r+1) P/n) of a bucket padded to P over n replicas (its padding in no payload), so the FP8
spans of each bucket give every payload exactly. A bucket without FP8 weights is gathered as without the flag:
P elements in the run's precision.

Under ZeRO-1/2 (`optim`, `optim_grads`) the distributed optimizer gathers every bucket of both buffers once a
step. Kept between steps, beside the weights (which stay in the run's precision, whole): every FP8 weight's
codes, one byte an element of the whole weight on this rank, and each such bucket's gathered payloads (n of
them), allocated at its first gather.

Under ZeRO-3 (`optim_grads_params`) every unit (param_shard.py: the embedding, each layer, the head) is gathered
once in each microbatch's forward and once in its backward, prefetched or not, each gather moving its buckets
as above; a bucket in two units (the tied word embedding at pp 1, the embedding's and the head's) moves with
each. Fp8GatherBytes.gathered (and .experts_gathered) is one such pass (a step runs two a microbatch). Kept
between steps: this rank's own payload of each bucket holding FP8 weights (Fp8Shard._mine: one payload, the
longest's size). Held while a unit is gathered, beside its weights (sharding.py's gathered units: the flat
buckets stay allocated in the run's precision, the FP8 weights' elements unwritten): its buckets' code tensors
(one byte per FP8 weight element) and, from the all-gather's launch to its landing, the payloads it gathers
into (n of them; none at one replica, whose own payload is unpacked). A unit's gather launches all its buckets,
then lands them in turn (an MoE layer's dense bucket before its experts': its first parameter, a norm's or the
attention's, comes first): a bucket's codes are allocated while its payloads and those of the buckets after it
are still held. Without prefetch one unit is held at a time; with --overlap-param-gather the next unit's gather
(u_i+1 in forward, u_i-1 in backward) is launched once u_i has landed, so u_i's codes and the next unit's
payloads are held together. `transient` is the most of those bytes at once (Fp8Shard.peak_bytes). Not counted:
the temporaries of packing the payloads (a weight shard's codes as it is encoded), made once a step before any
unit is gathered.

Before the gathers (once a step) the step all-reduces (MAX) one fp32 amax per FP8 linear's weight over the
replicas and, under tensorwise (current) scaling at tp x cp > 1, over those ranks too; and one fp32 amax per
expert of each stacked expert weight (E/ep of them) over the experts' replicas (the experts take their current
amax under every recipe, and are whole on every tp rank): vectors of a few hundred or thousand floats,
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
    gathered: int  # what the dense buffer's all-gathers produce: ZeRO-1/2 in a step, ZeRO-3 in one pass of units
    payloads: int  # kept between steps: ZeRO-1/2 the FP8 buckets' gathered payloads, ZeRO-3 this rank's own
    codes: int     # ZeRO-1/2: the FP8 weights' codes, one byte an element, kept between steps (ZeRO-3: none kept)
    weights: int   # FP8 linears' weights: the dense amax all-reduce carries one fp32 for each
    transient: int = 0  # ZeRO-3: the most code tensors and in-flight payloads its unit gathers hold at once
    experts_gathered: int = 0  # what the experts' buffer's all-gathers produce (the same passes as `gathered`)
    expert_amaxes: int = 0     # the experts' amax all-reduce: one fp32 per expert of each stacked weight
    # (payloads, codes and transient count both buffers)


class _Bucket(NamedTuple):
    gather: int    # bytes one all-gather of it produces
    payload: int   # its longest replica payload (0: no FP8 weights, gathered as without the flag)
    codes: int     # its FP8 weights' elements
    weights: int   # its FP8 weights
    scratch: int   # ZeRO-3: bytes its gather lands from (its n payloads; none at one replica)


def fp8_gather_bytes(model: ModelConfig, layout: Layout, precision: str, rank: int,
                     bucket_numel: Optional[int] = None, prefetch: bool = False) -> Fp8GatherBytes:
    """The bytes of pipeline rank `rank` with --fp8-param-gather (see the module doc), the dense buffer's and the
    routed experts'. `prefetch`: --overlap-param-gather (ZeRO-3's transient)."""
    size = PARAM_BYTES[precision]
    dense = _buckets(rank_chunks(model, layout, rank, False, bucket_numel), layout.shard_group, size)
    experts = _buckets(rank_chunks(model, layout, rank, True, bucket_numel), layout.expert_shard_group, size) \
        if model.num_experts else [(chunk, []) for chunk, _ in dense]
    linear_buckets = [b for _, chunk in dense for b in chunk]
    expert_buckets = [b for _, chunk in experts for b in chunk]
    every = linear_buckets + expert_buckets
    weights = sum(b.weights for b in linear_buckets)
    amaxes = sum(b.weights for b in expert_buckets) * ((model.num_experts or 0) // layout.ep)  # one per expert
    if not layout.sharding.params:
        return Fp8GatherBytes(sum(b.gather for b in linear_buckets), sum(b.gather for b in every if b.payload),
                              sum(b.codes for b in every), weights, 0, sum(b.gather for b in expert_buckets), amaxes)
    # the engine's units: their buckets in the order param_shard gathers them (forward order: the layout's reversed;
    # a unit's dense buckets before its experts')
    dense_units = [[_unit(d, u) for u in d[0].order] for d in dense]
    expert_units = [[_unit(e, u) for u in d[0].order] for d, e in zip(dense, experts)]
    units = [[a + b for a, b in zip(d, e)] for d, e in zip(dense_units, expert_units)]
    return Fp8GatherBytes(_one_pass(dense_units), sum(b.payload for b in every), 0, weights,
                          max([_held(chunk, prefetch) for chunk in units] or [0]), _one_pass(expert_units), amaxes)


def _buckets(chunks: list, n: int, size: int) -> list:
    """(layout, its _Buckets) of each chunk of one grad buffer, whose replicas are n."""
    return [(chunk, [_bucket(used, padded, spans, n, size)
                     for (used, padded), spans in zip(chunk.buckets, chunk.fp8)]) for chunk in chunks]


def _unit(chunk: tuple, unit) -> list:
    """The buckets of one buffer's chunk (layout, _Buckets) holding `unit`'s parameters, in forward order."""
    layout, buckets = chunk
    return [buckets[i] for i in sorted(layout.units.get(unit, ()), reverse=True)] if buckets else []


def _one_pass(units: list) -> int:
    """Bytes one pass of ZeRO-3's unit gathers produces: every unit of every chunk once, each with its buckets."""
    return sum(b.gather for chunk in units for unit in chunk for b in unit)


def _bucket(used: int, padded: int, spans: tuple, n: int, size: int) -> _Bucket:
    if not spans:
        return _Bucket(padded * size, 0, 0, 0, 0)
    payload = _longest_payload(used, padded // n, spans, size)
    return _Bucket(n * payload, payload, sum(hi - lo for lo, hi in spans), len(spans), n * payload if n > 1 else 0)


def _held(units: list, prefetch: bool) -> int:
    """Most code and in-flight payload bytes one chunk's unit gathers hold at once (Fp8Shard.peak_bytes)."""
    scratch = lambda unit: sum(b.scratch for b in unit)  # noqa: E731
    codes = lambda unit: sum(b.codes for b in unit)  # noqa: E731
    peak = 0
    for unit in units:  # landing: bucket j's codes allocated beside the payloads of j and the buckets after it
        fp8 = [b for b in unit if b.payload]
        for j in range(len(fp8)):
            peak = max(peak, codes(fp8[:j + 1]) + scratch(fp8[j:]))
    if prefetch:  # a unit landed, its neighbour launched (forward the next, backward the previous)
        for a, b in zip(units, units[1:]):
            peak = max(peak, codes(a) + scratch(b), codes(b) + scratch(a))
    return peak


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

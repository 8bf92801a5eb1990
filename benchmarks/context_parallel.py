"""Context parallelism on a long sequence: activation bytes, ring traffic and attention work per rank.

    python -m benchmarks.context_parallel   (from the repository root)

One Llama-shaped fp32 layer (benchmarks/memory.py's, grouped-query attention) runs forward and backward
on 4 gloo ranks at cp 1, 2 and 4 (p2p ring and all-gather) over a sequence of SEQ tokens. Per rank:
- saved-for-backward bytes (every storage autograd keeps, parameters excluded), against the tensor-by-
  tensor set of benchmarks/memory.py at s/cp tokens, and as a fraction of cp 1's: about 1/cp;
- bytes sent by the layer's attention (engine.parallel.comm.counting), against the ring volumes: with
  KV = one rank's K and V (2 x b x s/cp x nkv x d elements) in the activation dtype and dKV the same
  elements in fp32 (the gradients travel in fp32):
      p2p        forward (cp-1) KV;  backward (cp-1) KV + cp dKV   (each dK/dV makes cp hops, the last home)
      all_gather forward (cp-1) KV;  backward (cp-1) KV + (cp-1) dKV   (gather again, reduce-scatter)
- attention FLOPs the blocks computed (engine.parallel.ring_attention.counting), max over min rank.
"""
from __future__ import annotations

import sys

import torch

from benchmarks.memory import expected_saved, llama_config, measure
from benchmarks.spawn import spawn_rows
from engine.parallel import comm, ring_attention
from engine.parallel.topology import build_context

CASES = [(1, "p2p"), (2, "p2p"), (2, "all_gather"), (4, "p2p"), (4, "all_gather")]
SEQ, MICRO, WORLD = 2048, 1, 4


def ring_bytes(cfg, cp: int, comm_type: str, seq: int = SEQ, micro: int = MICRO, elem: int = 4) -> tuple:
    """(forward, backward) bytes one rank sends for one layer's attention, by the formulas above."""
    if cp == 1:
        return 0, 0
    kv_elems = 2 * micro * (seq // cp) * cfg.resolved_query_groups() * cfg.head_dim()
    kv, dkv = kv_elems * elem, kv_elems * 4
    hops = cp if comm_type == "p2p" else cp - 1
    return (cp - 1) * kv, (cp - 1) * kv + hops * dkv


def _measure_case(rank: int, cp: int, comm_type: str) -> dict:
    ctx = build_context(WORLD, rank, 1, 1, cp=cp, cp_comm_type=comm_type)
    cfg = llama_config("none")
    cfg.seq_length = SEQ
    with comm.counting() as sent, ring_attention.counting() as flops:
        saved, _, _ = measure(cfg, ctx, torch.device("cpu"), SEQ, MICRO)
    # measure() runs forward under the hooks, then backward: both are inside the counting blocks.
    group = ctx.cp_group
    row = dict(rank=rank, cp=cp, comm=comm_type, saved=saved,
               expected=sum(expected_saved(cfg, SEQ // cp, MICRO, 1, False, "none").values()),
               sent=sum(r.sent for r in sent.records if group is not None and r.group is group),
               analytic=sum(ring_bytes(cfg, cp, comm_type)), flops=flops.forward + flops.backward)
    ctx.destroy()
    return row


def _rows(rank: int) -> list:
    return [_measure_case(rank, cp, comm_type) for cp, comm_type in CASES]


def run() -> list:
    """One row per (case, rank): saved bytes and their expected value, bytes sent and the ring volume, FLOPs."""
    return spawn_rows(_rows, WORLD)


def summary(rows: list) -> list:
    """Per case: the busiest rank's saved bytes and their ratio to cp 1, traffic, FLOP balance."""
    base = max(r["saved"] for r in rows if r["cp"] == 1)
    table = []
    for cp, comm_type in CASES:
        case = [r for r in rows if (r["cp"], r["comm"]) == (cp, comm_type)]
        saved = max(r["saved"] for r in case)
        flops = [r["flops"] for r in case]
        table.append(dict(cp=cp, comm=comm_type, saved=saved, expected=case[0]["expected"], of_cp1=saved / base,
                          sent=max(r["sent"] for r in case), analytic=case[0]["analytic"],
                          flop_balance=max(flops) / min(flops) if cp > 1 else 1.0))  # cp 1: SDPA, not counted
    return table


def main() -> int:
    rows = summary(run())
    cfg = llama_config("none")
    print(f"one Llama-shaped fp32 layer (h={cfg.hidden_size}, heads={cfg.num_attention_heads}, "
          f"kv-groups={cfg.num_query_groups}), s={SEQ}, b={MICRO}, {WORLD} gloo ranks; per rank, forward + backward")
    print(f"{'cp':>2} {'comm':>10} | {'saved':>10} {'expected':>10} {'of cp 1':>7} | {'sent':>10} {'ring':>10} | "
          f"{'FLOPs max/min':>13}")
    for r in rows:
        print(f"{r['cp']:>2} {r['comm']:>10} | {r['saved']:>10,} {r['expected']:>10,} {r['of_cp1']:>7.3f} | "
              f"{r['sent']:>10,.0f} {r['analytic']:>10,} | {r['flop_balance']:>13.3f}")
    ok = all(r["saved"] == r["expected"] and r["sent"] == r["analytic"] and r["flop_balance"] <= 1.05 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

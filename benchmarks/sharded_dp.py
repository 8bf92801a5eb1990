"""Data-parallel sharding strategies: per-rank state bytes and bytes sent per step, against ZeRO's formulas.

    python -m benchmarks.sharded_dp   (from the repository root)

A Llama-shaped bf16 model (untied embeddings) trains one step of M microbatches per rank on DP gloo ranks
under each strategy. With P the parameter count and Pb the grad buffer's elements (P plus the padding that
makes every bucket a multiple of 64 x dp), per rank, after the step (Rajbhandari et al. 2020, section 3,
with this engine's dtypes: bf16 weights 2 B, fp32 main gradients 4 B, fp32 masters and two Adam moments 12 B):

    strategy             weights     gradients   optimizer      bound asserted
    no_shard             2 P         4 Pb        12 P           all of it, equal
    optim (ZeRO-1)       2 P         4 Pb        12 P/dp        optimizer <= 12 Pb/dp
    optim_grads (ZeRO-2) 2 P         4 Pb/dp     12 P/dp        weights whole, the rest <= 1/dp of Pb
    optim_grads_params   2 Pb/dp     4 Pb/dp     12 P/dp        all three <= 1/dp, plus one gathered unit
                                                                (two with --overlap-param-gather)

Transients are reported too: the largest full-size weights held at once (ZeRO-3: one unit, the largest
being the embedding or a layer) and the most full-size fp32 gradient staging alive at once (ZeRO-2/3: a
bucket or two, never the whole gradient).

Bytes sent on the dp group per step (ring volumes, engine.parallel.comm.counting; f = (dp-1)/dp):
    no_shard             all-reduce of the gradients              2 f 4 Pb
    optim                reduce-scatter + all-gather of weights   f 4 Pb + f 2 Pb
    optim_grads          a reduce-scatter per microbatch          M f 4 Pb + f 2 Pb
    optim_grads_params   per microbatch: gather for forward, again for backward, reduce-scatter
                                                                  M (2 f 2 Pb + f 4 Pb)
(scalars, the loss and the gradient norm, are left out; Adam's 4-byte step count per tensor is added
to the optimizer bound). The table prints measured and formula side by
side and the script exits non-zero when one differs or a bound fails.
"""
from __future__ import annotations

import sys
import time

import torch

from benchmarks.spawn import spawn_rows
from engine.config import Config, ModelConfig
from engine.layout import Sharding
from engine.optim import build_optimizer
from engine.parallel import comm
from engine.parallel.topology import build_context
from engine.pipeline.partition import build_model_chunks

DP, MICRO, M, SEQ, VOCAB = 4, 1, 2, 32, 512
CASES = [("no_shard", False), ("optim", False), ("optim_grads", False), ("optim_grads_params", False),
         ("optim_grads_params", True)]


def config(strategy: str, prefetch: bool) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(hidden_dropout=0.0, attention_dropout=0.0, num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=176, seq_length=SEQ, vocab_size=VOCAB, normalization="RMSNorm",
                            swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                            untie_embeddings_and_output_weights=True)
    cfg.training.bf16 = True
    cfg.parallel.data_parallel_sharding_strategy = strategy
    cfg.parallel.overlap_param_gather = prefetch
    return cfg


def _step(chunks, opt, ctx) -> tuple:
    """One training step of M microbatches; (bytes sent on the dp group by payload > 16 B, seconds)."""
    model = chunks[0]
    g = torch.Generator().manual_seed(ctx.dp_rank)
    start = time.perf_counter()
    with comm.counting() as sent:
        opt.start_step(M)
        for _ in range(M):
            tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
            (model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean() / M).backward()
        opt.finish_grad_sync()
        opt.step(1e-4)
    seconds = time.perf_counter() - start
    group = ctx.dp_cp_group
    return sum(r.sent for r in sent.records if r.group is group and r.payload > 16), seconds


def _measure(rank: int, strategy: str, prefetch: bool) -> dict:
    ctx = build_context(DP, rank, 1, 1, sharding=strategy)
    cfg = config(strategy, prefetch)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB, dtype=torch.bfloat16)
    opt = build_optimizer(cfg, chunks, ctx, bucket_numel=50_000)
    _step(chunks, opt, ctx)  # warm-up: the second step is the one measured
    sent, seconds = _step(chunks, opt, ctx)
    buffer = opt.buffer
    row = dict(strategy=strategy, prefetch=prefetch, rank=rank, sent=sent, seconds=seconds,
               P=sum(p.numel() for p in buffer.params), Pb=sum(b.size for b in buffer.buckets),
               unit=max(sum(s.bucket.size for s in u.buckets) for u in opt.sharder.chunks[0]) * 2
               if opt.sharder else 0,
               gathered=opt.sharder.peak_gathered_bytes if opt.sharder else 0,
               staging=buffer.peak_staging_bytes, steps=4 * len(opt._entries), **opt.memory_bytes())
    ctx.destroy()
    return row


def formulas(strategy: str, P: int, Pb: int) -> dict:
    """Per-rank bytes (weights, gradients) and bytes sent per step, by the formulas of the docstring."""
    f, sharding = (DP - 1) / DP, Sharding(strategy)
    weights = 2 * Pb // DP if sharding.params else 2 * P
    grads = 4 * Pb // DP if sharding.grads else 4 * Pb
    if not sharding.optimizer:
        sent = 2 * f * 4 * Pb
    elif sharding.params:
        sent = M * (2 * f * 2 * Pb + f * 4 * Pb)
    else:
        sent = (M if sharding.grads else 1) * f * 4 * Pb + f * 2 * Pb
    return dict(params=weights, grads=grads, sent=sent)


def _rows(rank: int) -> list:
    return [_measure(rank, s, p) for s, p in CASES]


def run() -> list:
    """Every rank's rows."""
    return spawn_rows(_rows, DP)


def summary(rows: list) -> list:
    """Per case, the busiest rank's bytes, the formulas, and whether every bound holds."""
    table, base = [], None
    for strategy, prefetch in CASES:
        case = [r for r in rows if (r["strategy"], r["prefetch"]) == (strategy, prefetch)]
        top = {k: max(r[k] for r in case) for k in ("params", "grads", "optimizer", "gathered", "staging", "sent",
                                                    "seconds")}
        P, Pb, unit = case[0]["P"], case[0]["Pb"], case[0]["unit"]
        want = formulas(strategy, P, Pb)
        # Adam also keeps a 4-byte step count per tensor it updates
        optim_bound = (12 * Pb // DP if Sharding(strategy).optimizer else 12 * P) + max(r["steps"] for r in case)
        held = (2 if prefetch else 1) * unit
        ok = (top["params"] == want["params"] and top["grads"] == want["grads"] and top["optimizer"] <= optim_bound
              and abs(top["sent"] - want["sent"]) < 1 and top["gathered"] <= held
              and (not Sharding(strategy).grads or top["staging"] < 4 * Pb))
        base = base or top["seconds"]
        table.append(dict(strategy=strategy + (" +prefetch" if prefetch else ""), P=P, Pb=Pb, **top,
                          optim_bound=optim_bound, unit_bound=held, want=want, time_ratio=top["seconds"] / base,
                          ok=ok))
    return table


def main() -> int:
    table = summary(run())
    first = table[0]
    print(f"Llama-shaped bf16 model, {first['P']:,} parameters, untied embeddings, dp {DP}, {M} microbatches of "
          f"{MICRO}x{SEQ} per rank; per rank, busiest rank, bytes; Pb (grad buffer elements, padding included): "
          + ", ".join(f"{r['strategy']} {r['Pb']:,}" for r in table))
    print(f"{'strategy':>27} | {'weights':>9} {'formula':>9} | {'grads':>9} {'formula':>9} | {'optimizer':>9} "
          f"{'<=':>9} | {'gathered':>8} {'<=':>8} | {'staging':>8} | {'sent/step':>10} {'formula':>10} | "
          f"{'time':>5} ok")
    for r in table:
        w = r["want"]
        print(f"{r['strategy']:>27} | {r['params']:>9,} {w['params']:>9,} | {r['grads']:>9,} {w['grads']:>9,} | "
              f"{r['optimizer']:>9,} {r['optim_bound']:>9,} | {r['gathered']:>8,} {r['unit_bound']:>8,} | "
              f"{r['staging']:>8,} | {r['sent']:>10,.0f} {w['sent']:>10,.0f} | {r['time_ratio']:>5.2f} "
              f"{'yes' if r['ok'] else 'NO'}")
    print("time: CPU step time relative to no_shard in the same run (gloo on CPU; not a GPU figure)")
    return 0 if all(r["ok"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())

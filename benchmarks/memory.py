"""Bytes a transformer layer saves for backward, measured against what the architecture needs.

    python benchmarks/memory.py [--breakdown]

For tp 1, tp 2 and tp 2 + sequence parallelism, each with no, selective and full recomputation, one
Llama-shaped layer (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases, fp32) runs forward under
`torch.autograd.graph.saved_tensors_hooks`; every tensor autograd keeps is recorded by its storage, each
storage counted once, parameters left out. The expected set is derived tensor by tensor (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4, with flash attention:
the attention output and its log-sum-exp instead of the s x s scores), for one microbatch on one tp rank:

    norm inputs + 1/rms per row       [s', b, h] + [s', b]      (x2: attention and MLP norms)
    QKV input (the norm output)       [s', b, h]                s' = s/tp under SP: the shard, re-gathered in backward
    Q, K, V after RoPE                [s, b, nq/tp, d], [s, b, nkv/tp, d] x2
    attention output, log-sum-exp     [s, b, nq/tp, d], [b, nq/tp, s]   (fp32 lse)
    MLP input (the norm output)       [s', b, h]
    fc1 output (gate and up)          [s, b, 2f/tp]
    SwiGLU output (fc2 input)         [s, b, f/tp]
    RoPE angle table                  [s, d/2] fp32             (built once per forward, shared by all layers)

Selective recomputation drops the log-sum-exp (the core attention is replayed from Q, K, V); full
recomputation keeps only the layer input [s', b, h] and the RoPE angles. Dropout is off, so no masks.

The masked path (`PACKED`: samples packing documents under --reset-attention-mask --reset-position-ids,
through SDPA with the documents as a boolean mask) keeps the same set but for two items, the analytic bound
of that path:

    RoPE angle table, per sample      [s, b, d/2] fp32          (each sample its own positions; still shared)
    attention mask, additive          [b, 1, s, s]              (SDPA's copy of the boolean mask, in the
                                                                 activations' dtype; not kept when selective
                                                                 recomputation replays the attention core)

The fused kernels (Triton, flash-attn's varlen form) keep no mask at all: the documents' bounds, [2, b, s]
int32, are one per microbatch.
Beside each case the planner's activation term (engine/planner/activations.py, the published formula in
2-byte units with dropout masks, scaled here to fp32) is printed for the same shapes.

On a CUDA machine (`--device cuda`: one process per GPU, the tp 2 cases need two) the same cases also
report `torch.cuda.max_memory_allocated` growth over the layer's forward.
"""
from __future__ import annotations

import functools
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import ModelConfig
from engine.documents import Packing
from engine.model import GPTModel
from engine.parallel import context_split
from engine.parallel.topology import build_context
from engine.planner.activations import layer_activation_bytes

CASES = [(tp, sp, rc) for tp, sp in ((1, False), (2, False), (2, True)) for rc in ("none", "selective", "full")]
PACKED = [(tp, sp, rc) for tp, sp in ((1, False), (2, True)) for rc in ("none", "selective", "full")]
SEQ, MICRO = 64, 2
EOD, DOCUMENT_ENDS = 255, ((4, 20, 21, 40), (30, 50))  # the packed cases' documents: where each sample's end
TARGET = 1.05


def llama_config(recompute: str) -> ModelConfig:
    return ModelConfig(hidden_dropout=0.0, attention_dropout=0.0, num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=2, seq_length=SEQ,
                       vocab_size=256, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                       ffn_hidden_size=352, untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                       attention_backend="sdpa", recompute_granularity=None if recompute == "none" else recompute)


def expected_saved(cfg: ModelConfig, s: int, b: int, tp: int, sp: bool, recompute: str, elem: int = 4,
                   packed: bool = False) -> dict:
    """Name -> bytes of every tensor one layer must keep for backward (one microbatch, one tp rank); `packed`: the
    masked path of packed documents."""
    h, d = cfg.hidden_size, cfg.head_dim()
    nq, nkv, f = cfg.num_attention_heads // tp, cfg.resolved_query_groups() // tp, cfg.resolved_ffn_hidden_size() // tp
    s_local = s // tp if sp else s
    rope = {"RoPE angle table": s * (d // 2) * 4 * (b if packed else 1)}
    if recompute == "full":
        return {"layer input": s_local * b * h * elem, **rope}
    items = {
        "attention norm input + 1/rms": s_local * b * h * elem + s_local * b * 4,
        "QKV input" + (" (shard)" if sp else ""): s_local * b * h * elem,
        "Q, K, V": s * b * (nq + 2 * nkv) * d * elem,
        "attention output": s * b * nq * d * elem,
        "attention log-sum-exp": b * nq * s * 4,
        "MLP norm input + 1/rms": s_local * b * h * elem + s_local * b * 4,
        "MLP input" + (" (shard)" if sp else ""): s_local * b * h * elem,
        "fc1 output (gate, up)": s * b * 2 * f * elem,
        "SwiGLU output": s * b * f * elem,
        **rope,
    }
    if recompute == "selective":
        del items["attention log-sum-exp"]
    elif packed:
        items["attention mask (SDPA's additive copy)"] = b * s * s * elem
    return items


def packed_tokens(s: int, b: int) -> torch.Tensor:
    """[b, s] tokens whose documents end at DOCUMENT_ENDS (the last one at the end of the sample)."""
    tokens = torch.zeros(b, s, dtype=torch.long)
    for row, ends in zip(tokens, DOCUMENT_ENDS):
        row[list(ends)] = EOD
    return tokens


class SavedBytes:
    """Unique storages autograd saves while active, parameters excluded: {storage ptr: (bytes, shape)}."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.storages = {}

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip:
            self.storages.setdefault(st.data_ptr(), (st.nbytes(), tuple(t.shape), str(t.dtype)))
        return t

    def total(self) -> int:
        return sum(n for n, _, _ in self.storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def measure(cfg: ModelConfig, ctx, device, seq: int = SEQ, micro: int = MICRO, packed: bool = False) -> tuple:
    """(saved bytes of layer 1, storages, cuda peak growth or None) for one forward of a 2-layer model;
    under context parallelism, of this rank's positions; `packed`: of samples packing documents, through the
    door (engine/parallel/context_split.shard_batch) as a training step takes them."""
    model = GPTModel(cfg, ctx, pre_process=False, post_process=False, device=device).train()
    s_local = ctx.activation_shape(seq, micro, cfg.hidden_size)[0]
    torch.manual_seed(0)
    x = torch.randn(s_local, micro, cfg.hidden_size, device=device, requires_grad=True)
    packing = Packing(EOD, reset_position_ids=True, reset_attention_mask=True) if packed else Packing()
    door = context_split.shard_batch({"tokens": packed_tokens(seq, micro).to(device)}, ctx, packing)
    positions, documents = door["positions"], door["documents"]
    tables = model.rope_freqs(door["position_ids"])
    layer = model.layers["1"]
    saved = SavedBytes(model.parameters())
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with saved.hooks():
        if cfg.recompute_granularity == "full":
            from engine.parallel.recompute import recompute
            y = recompute(functools.partial(layer, positions=positions, documents=documents), ctx.rng, x, tables)
        else:
            y = layer(x, tables, positions, documents)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    y.sum().backward()  # the saved set must be a working one
    return saved.total(), saved.storages, peak


def _worker(rank, world, init_file, device_type, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    rows = []
    cases = [(c, False) for c in CASES] + [(c, True) for c in PACKED]
    for (tp, sp, rc), packed in [(c, p) for c, p in cases if c[0] <= world]:
        ctx = build_context(world, rank, tp, 1, sequence_parallel=sp, device_type=device_type)
        cfg = llama_config(rc)
        measured, storages, peak = measure(cfg, ctx, device, packed=packed)
        expected = expected_saved(cfg, SEQ, MICRO, tp, sp, rc, packed=packed)
        planner = 2 * layer_activation_bytes(cfg, SEQ, MICRO, tp, sp, rc, flash_attention=True)
        rows.append(dict(tp=tp, sp=sp, recompute=rc, packed=packed, measured=measured,
                         expected=sum(expected.values()), planner=planner, peak=peak, items=expected,
                         storages=sorted(storages.values(), key=lambda v: -v[0])))
        ctx.destroy()
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def run(device_type: str = "cpu") -> list:
    """Every case's measured and expected bytes (2 ranks; on a single GPU, the tp 1 cases only)."""
    world = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), device_type, out), nprocs=world, join=True)
        return torch.load(out, weights_only=False)


def table(rows: list, breakdown: bool = False) -> str:
    lines = [f"{'tp':>2} {'SP':>3} {'recompute':>9} {'packed':>6} | {'measured':>9} {'expected':>9} {'ratio':>6} | "
             f"{'planner':>9}" + (f" {'cuda peak':>9}" if rows and rows[0]["peak"] is not None else "")]
    for r in rows:
        line = (f"{r['tp']:>2} {'yes' if r['sp'] else 'no':>3} {r['recompute']:>9} "
                f"{'yes' if r.get('packed') else 'no':>6} | {r['measured']:>9,} "
                f"{r['expected']:>9,} {r['measured'] / r['expected']:>6.3f} | {r['planner']:>9,.0f}")
        if r["peak"] is not None:
            line += f" {r['peak']:>9,}"
        lines.append(line)
        if breakdown:
            lines += [f"      expected  {n:<32} {b:>9,}" for n, b in r["items"].items()]
            lines += [f"      saved     {str(shape):<24} {dtype:<14} {n:>9,}" for n, shape, dtype in r["storages"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--breakdown", action="store_true", help="list the expected items and the saved storages")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2
    rows = run(args.device)
    cfg = llama_config("none")
    print(f"saved-for-backward bytes per layer: Llama-shaped fp32 layer h={cfg.hidden_size} "
          f"heads={cfg.num_attention_heads} kv-groups={cfg.num_query_groups} ffn={cfg.ffn_hidden_size} (SwiGLU), "
          f"s={SEQ} b={MICRO}; "
          f"planner = engine/planner/activations.py's term (bf16 formula) x2")
    print(table(rows, args.breakdown))
    worst = max(r["measured"] / r["expected"] for r in rows)
    print(f"worst measured/expected: {worst:.3f} (target <= {TARGET})")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

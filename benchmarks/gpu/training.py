"""Section 4, one-GPU training speed and memory: Ternion's loop, a plain PyTorch loop and transformers, each
eager then under torch.compile, on a ~1.3B Llama-shaped model at seq 2048 and GPT-2 124M at seq 1024, in bf16.

Per model: the largest micro batch of a short descending list that fits with the three loops resident (an
out-of-memory answered by freeing and trying the next), a few warm-up rounds, then measured rounds
alternating the loops (bench.py). Then each loop's layers are compiled in place and the same again; the first
compiled steps are the warm-up and their time is reported as the compile cost. Per row: tokens/s, model
TFLOP/s (engine.flops: the Megatron count, no recomputation), MFU over the 989 TFLOP/s datasheet peak and over
the bf16 matmul rate the card section measured, peak memory, the planner's prediction for the same layout
(engine.planner.memory.memory_per_gpu) and the largest loss difference from the plain loop on the same
batches; each compiled row also says whether its gradients are its eager ones (grad_check), and each profiled
step's products are summed against the model's. Before the rounds, where the engine fuses its weight gradients
into the fp32 ones (CUDA), its fused gradients on one microbatch are checked against its unfused ones. The 1.3B model goes first: it is what the goals are about.
"""
from __future__ import annotations

import contextlib

import torch

from benchmarks.gpu import grad_check, models
from benchmarks.gpu.bench import MICROBATCHES, Bench, products_summed, release
from benchmarks.gpu.context import NEEDS_CUDA
from benchmarks.kernel_speed import significant
from benchmarks.train import process_group
from engine import flops
from engine.layout import Layout
from engine.parallel import grad_accumulation
from engine.planner.memory import memory_per_gpu
from engine.precision import precision_name

FAMILIES = {"llama": "Llama 1.24B (llama3-1b) seq 2048", "gpt2": "GPT-2 124M seq 1024"}
MICRO = {"llama": ((8, 4, 2, 1), (4, 2, 1), (2,)), "gpt2": ((32, 16, 8, 4), (16, 8, 4), (2,))}  # full, quick, dry
NEED = {"llama": (90, 60, 2), "gpt2": (40, 30, 2)}            # seconds worth starting a model, eager phase
COMPILE_NEED = {"llama": (75, 60, 2), "gpt2": (50, 40, 2)}   # three regional compiles and their rounds
PEAK = flops.GPU_PRESETS["h100-sxm"].peak_tflops              # 989: H100 SXM and H200 dense bf16
ANCHOR = "llm.c GPT-2 124M ~41% MFU; published 1-1.5B runs 40-50% MFU on H100"


def run(opts, record, earlier) -> None:
    matmul = earlier.get("card", {}).get("figures", {}).get("matmul_tflops", {}).get("value")
    with process_group(opts.cuda):
        for family in opts.models or FAMILIES:
            if record.has_time(f"{family} training", opts.pick(*NEED[family])):
                train(opts, record, family, matmul)


def train(opts, record, family: str, matmul) -> None:
    """Eager rows first and recorded at once, then the compiled ones if time allows: a kill during the
    (long, unpredictable) compilation keeps the eager figures."""
    bench = fit(opts, record, family)
    if bench is None:
        return
    unfused = contextlib.ExitStack()
    try:
        check_fusion(record, bench, unfused)
        warm, iters = opts.pick((2, 5), (1, 4), (1, 2))
        bench.rounds(warm, False, "eager")
        bench.rounds(iters, True, "eager")
        report(record, bench, "eager", matmul)
        if "engine" in bench.loops and record.has_time(f"{family} engine profile", opts.pick(10, 10, 2)):
            profile(record, bench, family, matmul)
        if record.has_time(f"{family} torch.compile", opts.pick(*COMPILE_NEED[family])):
            backend = "inductor" if opts.cuda else "eager"  # on CPU only dynamo's capture runs: no C++ build
            for name in list(bench.loops):
                try:
                    bench.compile(name, backend)
                except Exception as exc:  # noqa: BLE001 - recorded as that loop's compile row
                    bench.errors[(name, "compile")] = f"{type(exc).__name__}: {exc}"[:600]
                    bench.drop(name)
            bench.rounds(warm, False, "compile")
            bench.rounds(iters, True, "compile")
            checked = check_gradients(opts, record, bench)
            report(record, bench, "compile", matmul, backend, checked)
            for name in ("engine", "plain"):  # why the compiled loops differ (H200 11-27: plain 1.08x, fewer products)
                if name in bench.loops and record.has_time(f"{family} {name} compiled profile", opts.pick(10, 10, 2)):
                    profile(record, bench, family, matmul, name, "compile")
    finally:
        unfused.close()
        bench.close()


def check_fusion(record, bench, unfused: contextlib.ExitStack) -> None:
    """Where the engine fuses its weight gradients (CUDA; engine.parallel.grad_accumulation), its fused gradients on one
    microbatch against its unfused ones first: a row of the `fused_grads` table. If they differ or the fused step
    fails, the rest of this model's rows run unfused (`unfused` holds that until they are done), and a note says so:
    the rows are not lost to it."""
    loop = bench.loops.get("engine")
    if loop is None or not grad_accumulation.fused_count(p for _, p in grad_check.trainable(loop)):
        return
    try:
        result = grad_check.fused_vs_unfused(loop, bench.batch())
    except torch.OutOfMemoryError as exc:  # the check's extra set of gradients did not fit: no finding either way
        result = {"error": f"not checked: {exc}"[:300], "match": None}
    except Exception as exc:  # noqa: BLE001 - the fused step failing is this check's finding
        result = {"error": f"{type(exc).__name__}: {exc}"[:300], "match": False}
    release(bench.cuda)
    record.row("fused_grads", {"family": bench.family, **result})
    if result["match"] is False:
        unfused.enter_context(grad_accumulation.unfused())
        why = result.get("error") or (f"worst relative difference {result['worst_rel_diff']:.2e} in "
                                      f"{result['worst_param']}")
        record.note(f"{bench.family} engine: its fused weight gradients are not its unfused ones ({why}); its rows "
                    "run without gradient-accumulation fusion")


def check_gradients(opts, record, bench) -> dict:
    """{loop: whether its compiled gradients are its eager ones} (grad_check says why this is asked), each loop's
    comparison a row of the `compiled_grads` table; a loop that could not be checked is left out (None)."""
    checked = {}
    if not record.has_time(f"{bench.family} compiled gradients", opts.pick(20, 20, 2)):
        return checked
    batch = bench.batch()
    for name, loop in list(bench.loops.items()):
        try:
            result = grad_check.compiled_vs_eager(loop, batch)
        except Exception as exc:  # noqa: BLE001 - an out-of-memory here costs this check, not the rows
            result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        release(opts.cuda)
        checked[name] = result.get("match")
        record.row("compiled_grads", {"family": bench.family, "loop": name, **result})
        if checked[name] is False:
            record.note(f"{bench.family} {name}: its compiled gradients are not its eager ones ({result['missing']} "
                        f"missing, worst relative difference {result['worst_rel_diff']:.2e} in "
                        f"{result['worst_param']}): its compiled row is left out of the goals")
    return checked


def profile(record, bench, family: str, matmul, loop: str = "engine", phase: str = "eager") -> None:
    """Where one loop's step spends its device time: the top operators, and a note of the first five; its matrix
    products by shapes, and their sum against the model's (`product_totals`)."""
    rows, gemms = bench.profile(loop)
    step = phase if loop == "engine" else f"{phase} ({loop})"
    for row in rows:
        record.row("profile", {"family": family, "phase": step, **row})
    for row in gemms:
        record.row("gemms", {"family": family, "phase": step, **row})
    totals = product_totals(bench, gemms, matmul)
    record.row("product_totals", {"family": family, "phase": step, **totals})
    record.note(f"{family} {loop} step ({phase}), most device time: "
                + "; ".join(f"{r['op']} {100 * r['share']:.0f}%" for r in rows[:5])
                + f"; its products {totals['tflop']:.4g} TFLOP of the model's {totals['model_tflop']:.4g}"
                + (f", at {totals['rate_over_matmul']:.2f}x the card's matmul rate" if totals["rate_over_matmul"]
                   else ""))


def product_totals(bench, gemms: list, matmul) -> dict:
    """The profiled step's matrix products summed: TFLOP, device ms, their rate, that rate over the card's measured
    matmul rate, and the TFLOP the model's products need (engine.flops: the linears' and the output layer's;
    attention's own products run inside its kernels). A step whose products carry fewer TFLOP than the model's, or
    run above the card's rate, skipped some (H200, 2026-11-27: the compiled plain loop's ran at 1.15x)."""
    summed = products_summed(gemms)
    cfg = bench.cfg
    f = flops.forward_flops_per_sequence(cfg.model, cfg.model.seq_length)  # each product once forward, twice back
    model = 3 * (f["linear"] + f["logits"]) * cfg.training.global_batch_size / 1e12
    rate = summed["tflops_rate"]
    return {**summed, "model_tflop": significant(model, 6),
            "rate_over_matmul": round(rate / matmul, 3) if rate and matmul else None}


def fit(opts, record, family: str):
    """The Bench at the largest micro batch of the list that fits, or None (recorded why). A micro batch the
    planner says cannot fit is not tried (each try builds three models: seconds of the lease), except the last."""
    sizes = opts.pick(*MICRO[family])
    card = torch.cuda.get_device_properties(0).total_memory if opts.cuda else None
    for micro in sizes:
        need = resident_bytes(family, micro)
        if card and need > card and micro != sizes[-1]:
            record.note(f"{family}: micro batch {micro} not tried: the planner puts the three loops at "
                        f"{need / 2**30:.0f} GiB, the card has {card / 2**30:.0f}")
            continue
        try:
            bench = Bench(family, "tiny" if opts.dry_run else "full", micro, "cuda:0" if opts.cuda else "cpu")
            # one round of all three, their first warm-up: a loop whose steps run out of memory once the others
            # hold theirs (transformers' at micro batch 4 on the H100) shows there, not in the build
            bench.rounds(1, False, "eager")
            short = sorted(n for (n, _), e in bench.errors.items() if e.startswith("OutOfMemoryError"))
            if short and micro != sizes[-1]:
                bench.close()
                raise torch.cuda.OutOfMemoryError(f"the {', '.join(short)} loop's step")
            record.figure(f"{family}_micro_batch", micro, "sequences",
                          note=f"largest of {sizes} that fits with the three loops resident")
            return bench
        except torch.cuda.OutOfMemoryError as exc:
            record.note(f"{family}: micro batch {micro} does not fit with the three loops resident ({exc})"[:300])
        release(opts.cuda)  # outside the except: its traceback no longer holds the failed try's tensors
    record.skip(f"{family} training", f"out of memory at every micro batch of {sizes}")
    return None


def resident_bytes(family: str, micro: int) -> float:
    """The planner's bytes for the three loops at once: the engine's state, the plain and transformers loops'
    fp32 weights and AdamW state, and the largest one step adds (activations, logits, fp32 gradients)."""
    cfg = models.config(family, "full", micro, MICROBATCHES, 1, bf16=True)
    m = cfg.model
    engine = memory_per_gpu(m, Layout.from_config(cfg, 1), m.seq_length, MICROBATCHES, "bf16")
    plain = memory_per_gpu(m, Layout(micro_batch_size=micro), m.seq_length, MICROBATCHES, "fp32")
    kept = engine.weights + engine.grads + engine.optimizer + 2 * (plain.weights + plain.optimizer)
    return kept + max(engine.activations + engine.logits, plain.activations + plain.logits + plain.grads)


def report(record, bench, phase: str, matmul, backend: str = "", checked=None) -> None:
    """Each loop's row of `phase`; `checked`: {loop: whether its compiled gradients are its eager ones}."""
    for name in ("engine", "plain", "transformers"):
        row = {"model": FAMILIES[bench.family], "family": bench.family, "loop": name, "mode": phase,
               "compile_backend": backend, **shape(bench), **bench.summary(name, phase),
               "precision": precision(bench, name), "error": bench.errors.get((name, phase)),
               "grads_match_eager": (checked or {}).get(name)}
        row.update(speed(bench, row, matmul))
        row.update(memory(bench, name, row["peak_bytes"]))
        row["loss_max_diff_vs_plain"] = loss_gap(bench, name)
        record.row("training", row, line(row))


def shape(bench) -> dict:
    tr = bench.cfg.training
    return {"micro_batch": tr.micro_batch_size, "global_batch": tr.global_batch_size,
            "seq": bench.cfg.model.seq_length, "tokens_per_step": tr.global_batch_size * bench.cfg.model.seq_length}


def precision(bench, name: str) -> str:
    if not bench.cuda:
        return "fp32"
    if name == "engine":
        return "bf16 weights, fp32 master weights and gradients (--bf16)"
    return "fp32 weights, bf16 autocast"


def speed(bench, row: dict, matmul) -> dict:
    if not row["step_s"]:
        return {}
    model_flops = flops.flops_per_iteration(bench.cfg.model, row["global_batch"], row["seq"])
    tflops = model_flops / row["step_s"] / 1e12
    return {"tokens_per_s": round(row["tokens_per_step"] / row["step_s"], 1), "tflops": round(tflops, 2),
            "mfu_989": round(tflops / PEAK, 4), "mfu_measured": round(tflops / matmul, 4) if matmul else None,
            "mfu_anchor": ANCHOR}


def memory(bench, name: str, peak) -> dict:
    """The planner's prediction for this loop's layout: the engine's own, or (plain, transformers) fp32 weights
    and AdamW without sharding, the planner's fp32 formula."""
    cfg, m = bench.cfg, bench.cfg.model
    if name == "engine":
        layout, prec = Layout.from_config(cfg, 1), precision_name(cfg)
    else:
        layout, prec = Layout(micro_batch_size=cfg.training.micro_batch_size), "fp32"
    planned = memory_per_gpu(m, layout, m.seq_length, MICROBATCHES, prec, flash_attention=True).allocated
    out = {"planner_gib": round(planned / 2**30, 3), "planner_precision": prec}
    if peak is None:
        return {**out, "peak_gib": None, "peak_note": NEEDS_CUDA}
    return {**out, "peak_gib": round(peak / 2**30, 3), "planner_over_measured": round(planned / peak, 4)}


def loss_gap(bench, name: str):
    ours, plain = bench.losses.get(name, []), bench.losses.get("plain", [])
    gaps = [abs(a - b) for a, b in zip(ours, plain)]
    return max(gaps) if gaps else None


def line(row: dict) -> str:
    head = f"{row['family']} {row['loop']} {row['mode']} mbs {row['micro_batch']}: "
    if row["error"] or not row["step_s"]:
        return head + f"error {row['error']}"
    mfu = f"MFU {100 * row['mfu_989']:.1f}% of 989"
    if row.get("mfu_measured"):
        mfu += f", {100 * row['mfu_measured']:.1f}% of measured"
    peak = f"peak {row['peak_gib']:.2f} GiB (planner {row['planner_gib']:.2f})" if row["peak_gib"] is not None \
        else f"planner {row['planner_gib']:.3f} GiB"
    flag = "; its compiled gradients are NOT its eager ones" if row.get("grads_match_eager") is False else ""
    return head + f"{row['tokens_per_s']:.0f} tokens/s, {mfu}, {peak} (anchor {ANCHOR}){flag}"

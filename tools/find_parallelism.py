"""Pick a parallel layout: rank (tp, pp, vpp, dp, micro batch, recomputation, ...) for a model on N GPUs.

    python tools/find_parallelism.py --config configs/gpt3-175b.yaml --num-gpus 1024 --gpu a100-80g \\
        --global-batch-size 1536
    python tools/find_parallelism.py --config configs/llama3-8b.yaml --num-gpus 8 --tp 2 --pp 1
    python tools/find_parallelism.py --config configs/llama3-8b.yaml --num-gpus 64 --tokens 15e12
    python tools/find_parallelism.py --config configs/llama3-8b-128k.yaml --num-gpus 64 --tp 8 --cp 4 --pp 1
    python tools/find_parallelism.py --config configs/mixtral-8x7b.yaml --num-gpus 64 --tp 1 --pp 4 --ep 8
    python tools/find_parallelism.py --config configs/llama3-8b.yaml --num-gpus 16 --pipeline-schedule all \
        --data-parallel-sharding-strategy optim_grads
    python tools/find_parallelism.py --config configs/llama3-8b-128k.yaml --num-gpus 64 --mean-document-length 4096

Data-parallel sharding (no_shard, optim = ZeRO-1, optim_grads = ZeRO-2, optim_grads_params = ZeRO-3): every
strategy is tried (in the one-layout mode too) and the table's "sharding" column shows the one chosen, unless
--data-parallel-sharding-strategy fixes it. Pipeline schedules: the engine's default (1f1b, interleaved with
--vpp) unless --pipeline-schedule fixes one; --pipeline-schedule all also searches zb-h1 and zb-v.

The memory model is engine/planner/memory.py, the time model engine/planner/step_time.py (constants and
sources documented there and in layer_time.py and links.py, checked against published runs in
engine/planner/published.py), the search engine/planner/search.py (context parallelism is tried at every
sequence length, wherever each rank keeps at least 4096 tokens of a sequence; for a mixture of experts, expert
parallelism over the sizes dividing dp and the experts, and FLOPs count activated parameters).
After the table: what the search left out and why ("not searched:"), why the pick beats the runner-up (the
fastest fitting layout with other degrees) with both step times term by term ("why:"), and for a mixture of
experts that no published MoE run calibrates its step times ("uncalibrated:"; JSON rows: "calibrated").
Layouts that do not fit come after every one that fits, behind a rule. docs/planner.md explains all of it;
--mean-document-length L plans for samples packed with documents of L tokens under --reset-attention-mask:
attention (its time in the fused kernels, which skip other documents' blocks, and its FLOPs) counts each
document's square, the sum of L_i^2 over a sample's s / L documents, rather than s^2.
--verify builds every pipeline stage on the meta device and checks the analytic parameter counts.
Exit codes: 0 when a layout fits in memory, 1 when none does (the table or JSON is still printed, then
one line on stderr), 2 for a mistake on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine.cli import OneLineParser, parse_config
from engine.config import PIPELINE_SCHEDULES, SHARDING_STRATEGIES, ConfigError
from engine.config.fields import OPTIMIZERS
from engine.attention_mask import packed_lengths
from engine.flops import GPU_PRESETS, activated_params, attention_pairs, flops_per_iteration
from engine.layout import Layout, Sharding
from engine.optim.newton_schulz import MuonSettings
from engine.planner.memory import GIB
from engine.planner.params import params_per_rank
from engine.planner.explain import runner_up, why
from engine.planner.published import calibrated
from engine.planner.search import DEFAULT_SCHEDULES, chinchilla_optimal, not_searched, rank_key, rank_layouts
from engine.planner.step_time import Software, estimate
from engine.precision import precision_name
from engine.resolve import resolve
from engine.validation import validate


class UsageError(Exception):
    """A mistake on the command line; printed as one line, exit code 2."""


class _Parser(OneLineParser):
    """One line per mistake (an unknown flag names the nearest one), raised as a UsageError."""

    def error(self, message, hint="--help lists the flags"):
        raise UsageError(f"{message} (python tools/find_parallelism.py {hint})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="find_parallelism.py", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="model YAML (the trainer's --config file)")
    p.add_argument("--num-gpus", type=int, help="GPUs in the job (required except with --verify)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tp stays inside a node (default 8)")
    p.add_argument("--gpu", choices=sorted(GPU_PRESETS), default="h100-sxm", help="GPU preset (default h100-sxm)")
    p.add_argument("--gpu-tflops", type=float, help="override: dense bf16 peak TFLOP/s per GPU")
    p.add_argument("--gpu-memory-gb", type=float, help="override: memory per GPU, GiB")
    p.add_argument("--intra-node-gbps", type=float, help="override: NVLink bandwidth per GPU, one direction, Gbit/s")
    p.add_argument("--inter-node-gbps", type=float, help="override: network bandwidth per GPU, one direction, Gbit/s")
    p.add_argument("--global-batch-size", type=int, help="samples per iteration (default: the config's)")
    p.add_argument("--seq-length", type=int, help="tokens per sample (default: the config's)")
    p.add_argument("--mean-document-length", type=int,
                   help="samples pack documents of this many tokens, masked apart (--reset-attention-mask): "
                        "attention counts the sum of their squares (default: each sample one sequence)")
    p.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    p.add_argument("--json", action="store_true", help="print a JSON list of layouts instead of a table")
    one = p.add_argument_group("evaluate one layout (give at least --tp and --pp; sequence parallelism is "
                               "assumed when tp > 1, the distributed optimizer when dp > 1)")
    one.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int)
    one.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int)
    one.add_argument("--cp", "--context-parallel-size", dest="cp", type=int,
                     help="context-parallel size: each sequence split over this many ranks (default 1)")
    one.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int,
                     help="expert-parallel size, carved from dp: the experts split over this many dp ranks (default 1)")
    one.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int)
    one.add_argument("--micro-batch-size", type=int)
    one.add_argument("--recompute-granularity", choices=("none", "selective", "full"))
    one.add_argument("--decoder-first-pipeline-num-layers", type=int, help="layers on the first stage (uneven split)")
    one.add_argument("--decoder-last-pipeline-num-layers", type=int, help="layers on the last stage (uneven split)")
    p.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES,
                   help="what is sharded over dp x cp (ZeRO-1/2/3: optim, optim_grads, optim_grads_params); "
                        "default: all four are tried and the table shows the one chosen")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="adam or muon (default: the config's): Muon's state "
                                                          "and its Newton-Schulz work and exchanges are priced")
    p.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES + ("all",),
                   help="pipeline schedule; default: the engine's (1f1b, interleaved with vpp > 1); 'all' also "
                        "searches the zero-bubble schedules zb-h1 and zb-v")
    plan = p.add_argument_group("compute planning")
    plan.add_argument("--tokens", type=float, help="training tokens, e.g. 300e9")
    plan.add_argument("--chinchilla", action="store_true", help="train on 20 tokens per parameter (Hoffmann et al. 2022)")
    p.add_argument("--verify", action="store_true",
                   help="build each pipeline stage on the meta device and check the analytic parameter counts")
    return p


def _gpu(args):
    spec = GPU_PRESETS[args.gpu]
    flags = {"peak_tflops": "gpu_tflops", "memory_gib": "gpu_memory_gb", "nvlink_gbps": "intra_node_gbps",
             "network_gbps": "inter_node_gbps"}
    overrides = {field: getattr(args, flag) for field, flag in flags.items() if getattr(args, flag) is not None}
    for field, value in overrides.items():
        if value <= 0:
            raise UsageError(f"--{flags[field].replace('_', '-')} must be positive, got {value}")
    return dataclasses.replace(spec, **overrides)


def _check(args, cfg):
    if args.num_gpus is None:
        raise UsageError("--num-gpus is required (the GPUs of the job), e.g. --num-gpus 64")
    if args.num_gpus < 1 or args.gpus_per_node < 1:
        raise UsageError("--num-gpus and --gpus-per-node must be at least 1")
    if args.num_gpus > args.gpus_per_node and args.num_gpus % args.gpus_per_node:
        raise UsageError(f"--num-gpus {args.num_gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}; "
                         "use whole nodes")
    if (args.tp is None) != (args.pp is None):
        raise UsageError("give both --tp and --pp to evaluate one layout, or neither to rank all layouts")
    if args.cp is not None and (args.tp is None or args.cp < 1):
        raise UsageError("--cp needs --tp and --pp (one layout) and must be at least 1; without them the search "
                         "tries cp itself for long sequences")
    if args.ep is not None and (args.tp is None or args.ep < 1):
        raise UsageError("--ep needs --tp and --pp (one layout) and must be at least 1; without them the search "
                         "tries ep itself for a mixture of experts")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise UsageError("--global-batch-size must be at least 1")
    if args.tokens is not None and args.tokens <= 0:
        raise UsageError("--tokens must be positive")
    if args.mean_document_length is not None and args.mean_document_length < 1:
        raise UsageError(f"--mean-document-length {args.mean_document_length}: give the documents' mean length in "
                         "tokens (at least 1), or leave it out for samples of one sequence")
    if args.pipeline_schedule == "all" and args.tp is not None:
        raise UsageError("--pipeline-schedule all searches the schedules; with --tp and --pp (one layout) name one "
                         f"of {', '.join(PIPELINE_SCHEDULES)}")


def _given_layout(args, cfg, batch) -> Layout:
    """The one layout asked for, checked by the trainer's own validation. Sequence parallelism is on
    whenever tp > 1 (it only saves memory); the sharding strategy is --data-parallel-sharding-strategy, or
    optim when dp x cp > 1 (estimate_given tries the others)."""
    cp = args.cp or 1
    if args.num_gpus % (args.tp * cp * args.pp):
        raise UsageError(f"--tp {args.tp} x --cp {cp} x --pp {args.pp} = {args.tp * cp * args.pp} does not divide "
                         f"--num-gpus {args.num_gpus}")
    if args.tp > args.gpus_per_node:
        raise UsageError(f"--tp {args.tp} exceeds --gpus-per-node {args.gpus_per_node}; a TP group stays in a node")
    par = cfg.parallel
    keep_split = args.pp == cfg.pp and args.vpp is None  # the config's vpp / uneven stages still apply
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None and keep_split:
        first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    dp = args.num_gpus // (args.tp * cp * args.pp)
    ep = args.ep or par.expert_model_parallel_size
    strategy = Sharding.of(args.data_parallel_sharding_strategy, dp * cp > 1).strategy
    c = dataclasses.replace(cfg)
    c.parallel = dataclasses.replace(
        par, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size if keep_split else args.vpp,
        decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
        sequence_parallel=args.tp > 1, use_distributed_optimizer=False, gpus_per_node=args.gpus_per_node,
        expert_model_parallel_size=ep, data_parallel_sharding_strategy=strategy,
        pipeline_schedule=args.pipeline_schedule or (par.pipeline_schedule if keep_split else None))
    c.training = dataclasses.replace(cfg.training, global_batch_size=batch,
                                     micro_batch_size=args.micro_batch_size or cfg.training.micro_batch_size)
    c.data = dataclasses.replace(cfg.data, mock_data=True)
    c.checkpoint = dataclasses.replace(cfg.checkpoint, load=None)
    validate(c, args.num_gpus)
    recompute = args.recompute_granularity or cfg.model.recompute_granularity or "none"
    return dataclasses.replace(Layout.from_config(c, args.num_gpus), recompute=recompute)


def estimate_given(args, cfg, batch, seq, gpu, sw):
    """The given layout's estimate; without --data-parallel-sharding-strategy, the best of the strategies
    (engine.planner.search.rank_key: the fastest that fits, else the nearest to fitting)."""
    layout = _given_layout(args, cfg, batch)
    strategies = [layout.sharding_strategy] if args.data_parallel_sharding_strategy or layout.shard_group == 1 \
        else SHARDING_STRATEGIES
    ests = [estimate(cfg.model, dataclasses.replace(layout, sharding_strategy=s), gpu, batch, seq, args.gpus_per_node,
                     sw) for s in strategies]
    return min(ests, key=rank_key)


def torchrun_command(args, layout: Layout, batch: int, seq: int, precision: str) -> str:
    nodes = max(1, args.num_gpus // args.gpus_per_node)
    per_node = min(args.num_gpus, args.gpus_per_node)
    cmd = ["torchrun", f"--nnodes {nodes}", f"--nproc-per-node {per_node}"]
    if nodes > 1:
        cmd += ["--rdzv-backend c10d", "--rdzv-endpoint $MASTER_ADDR:29500"]
    cmd += ["launch/pretrain_gpt.py", f"--config {args.config}",
            f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}"]
    if layout.cp > 1:
        cmd.append(f"--context-parallel-size {layout.cp}")
    if layout.ep > 1:
        cmd.append(f"--expert-model-parallel-size {layout.ep}")
    cmd += layout.schedule.flags
    if layout.first_stage_layers is not None:
        cmd += [f"--decoder-first-pipeline-num-layers {layout.first_stage_layers}",
                f"--decoder-last-pipeline-num-layers {layout.last_stage_layers}"]
    cmd += [f"--micro-batch-size {layout.micro_batch_size}", f"--global-batch-size {batch}", f"--seq-length {seq}",
            f"--gpus-per-node {args.gpus_per_node}"]
    if layout.sequence_parallel:
        cmd.append("--sequence-parallel")
    if layout.recompute != "none":
        cmd.append(f"--recompute-granularity {layout.recompute}")
    cmd += layout.sharding.flags
    if layout.shard_group > 1:
        cmd.append("--overlap-grad-reduce")
    if precision != "fp32":
        cmd.append(f"--{precision}")
    if args.mean_document_length:
        cmd.append("--reset-attention-mask")
    return " ".join(cmd)


def _verify(args, cfg) -> int:
    """Analytic vs meta-device parameter counts for the config's layout (or --tp/--pp/--vpp/--ep)."""
    from engine.planner.verify import verify
    par = cfg.parallel
    tp, pp = args.tp or cfg.tp, args.pp or cfg.pp
    vpp = args.vpp or (Layout.from_config(cfg, cfg.tp * cfg.pp * cfg.cp).vpp if args.pp is None else 1)
    ep = args.ep or par.expert_model_parallel_size  # dp = ep: the smallest grid holding the expert ranks
    sp = par.sequence_parallel or (tp > 1 and bool(cfg.model.num_experts))  # MoE with tp > 1 needs SP
    c = dataclasses.replace(cfg)
    c.parallel = dataclasses.replace(par, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, context_parallel_size=1,
                                     expert_model_parallel_size=ep, sequence_parallel=sp)
    c.data = dataclasses.replace(cfg.data, mock_data=True)
    c.checkpoint = dataclasses.replace(cfg.checkpoint, load=None)
    # Parameter counts do not depend on the batch: any size the schedule accepts will do.
    c.training = dataclasses.replace(cfg.training, global_batch_size=cfg.training.micro_batch_size * pp * ep,
                                     rampup_batch_size=None)
    validate(c, tp * pp * ep)
    resolve(c, tp * pp * ep)
    first, last = (par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers) \
        if args.pp is None else (None, None)
    ok, lines = verify(c, Layout(tp, pp, ep, vpp, sequence_parallel=sp, first_stage_layers=first,
                                 last_stage_layers=last, ep=ep))
    print("\n".join(lines))
    print("analytic counts match the model" if ok else "MISMATCH between the analytic count and the model")
    return 0 if ok else 1


def _plan(args, cfg, est, batch, seq) -> dict:
    """Compute planning for the best layout: FLOPs, days, GPU-hours, Chinchilla-optimal size."""
    n_params = sum(params_per_rank(cfg.model, Layout()))
    tokens = 20.0 * n_params if args.chinchilla else args.tokens
    pairs = batch * attention_pairs(cfg.model, packed_lengths(seq, args.mean_document_length))
    flops = flops_per_iteration(cfg.model, batch, seq, pairs=pairs) / (batch * seq) * tokens
    days = tokens / est.tokens_per_s / 86400
    opt_n, opt_d = chinchilla_optimal(flops)
    return dict(params=n_params, tokens=tokens, training_flops=flops, days=days,
                gpu_hours=days * 24 * args.num_gpus, chinchilla_params=opt_n, chinchilla_tokens=opt_d)


def _table(rows) -> str:
    head = ("tp", "cp", "pp", "vpp", "dp", "ep", "mb", "sp", "dopt", "sharding", "schedule", "recompute", "mem GiB",
            "fits", "step s", "tokens/s", "TFLOP/s", "MFU")
    lines = [head]
    for i, e in enumerate(rows):
        if i and rows[i - 1].fits and not e.fits:
            lines.append(None)  # a rule: the layouts below do not fit, whatever their speed
        lay = e.layout
        vpp = f"{lay.first_stage_layers}/../{lay.last_stage_layers}" if lay.first_stage_layers is not None else lay.vpp
        lines.append((lay.tp, lay.cp, lay.pp, vpp, lay.dp, lay.ep, lay.micro_batch_size, "y" if lay.sequence_parallel else "-",
                      "y" if lay.distributed_optimizer else "-", lay.sharding_strategy,
                      lay.pipeline_schedule if lay.pp > 1 else "-",
                      lay.recompute, f"{e.memory.total / GIB:.1f}",
                      "yes" if e.fits else "NO", f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}",
                      f"{e.tflops_per_gpu:.1f}", f"{e.mfu * 100:.1f}%"))
    widths = [max(len(str(r[i])) for r in lines if r) for i in range(len(head))]
    rule = "-- these do not fit in memory (ranked after every layout that fits) --"
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) if r else rule for r in lines)


def _report(args, cfg, rows: list, gpu, run: tuple, schedules, plan) -> None:
    """The text output: the model and machine, the table of the best layouts, then the caveats, what was not
    searched (`schedules`: those searched, None for one given layout), why the pick, and its command line."""
    batch, seq, precision = run
    shown = rows[:max(1, args.top)]
    fitting = sum(e.fits for e in rows)
    print(f"{cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
          f"{sum(params_per_rank(cfg.model, Layout())) / 1e9:.2f}B params{_moe_summary(cfg.model)} on "
          f"{args.num_gpus} x {gpu.name} "
          f"({gpu.peak_tflops:.0f} TFLOP/s, {gpu.memory_gib:.0f} GiB); global batch {batch} x {seq} tokens, {precision}")
    print(f"{len(rows)} layout(s) evaluated, {fitting} fit in memory\n")
    print(_table(shown))
    if not calibrated(cfg.model):
        print("\nuncalibrated: no published mixture-of-experts run is in the step-time model's calibration set, so "
              "these step times and MFU are the dense model's constants applied to experts; take them as a ranking, "
              "not a forecast (docs/planner.md)")
    best = rows[0]
    if args.tp is None:
        print("\nnot searched: " + "; ".join(not_searched(cfg.model, args.num_gpus, args.gpus_per_node, seq,
                                                          schedules)))
        second = runner_up(rows) if best.fits else None
        if second is not None:
            print("\nwhy: " + why(best, second))
    if best.fits:
        print(("\ncommand line:\n  " if args.tp else "\nbest layout:\n  ") + torchrun_command(args, best.layout, batch, seq, precision))
    if plan:
        print(f"\ncompute plan for the best layout: {plan['tokens']:.3g} tokens, {plan['training_flops']:.3g} FLOPs, "
              f"{plan['days']:.1f} days on {args.num_gpus} GPUs, {plan['gpu_hours']:,.0f} GPU-hours\n"
              f"Chinchilla-optimal for this budget (~20 tokens/param): {plan['chinchilla_params'] / 1e9:.2f}B params "
              f"on {plan['chinchilla_tokens']:.3g} tokens (this model: {plan['params'] / 1e9:.2f}B)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = parse_config(["--config", args.config])
    if args.verify:
        return _verify(args, cfg)
    _check(args, cfg)
    batch = args.global_batch_size or cfg.training.global_batch_size
    if not batch:
        raise UsageError(f"{args.config} sets no global_batch_size; pass --global-batch-size")
    cfg.training.global_batch_size = batch
    resolve(cfg, args.num_gpus)
    seq = args.seq_length or cfg.model.seq_length
    cfg.model.seq_length = seq
    gpu, precision = _gpu(args), precision_name(cfg)
    cfg.optim.optimizer = args.optimizer or cfg.optim.optimizer
    muon = MuonSettings.of(cfg.optim) if cfg.optim.optimizer == "muon" else None
    sw = Software(precision=precision, document_length=args.mean_document_length, muon=muon,
                  fp8=cfg.training.fp8_recipe if cfg.training.fp8_format else None,
                  fp8_format=cfg.training.fp8_format or "hybrid",
                  fp8_param_gather=cfg.training.fp8_param_gather,
                  fp8_output_layer=cfg.training.fp8_output_layer)
    if args.tp is not None:
        rows = [estimate_given(args, cfg, batch, seq, gpu, sw)]
    else:
        strategies = (args.data_parallel_sharding_strategy,) if args.data_parallel_sharding_strategy \
            else SHARDING_STRATEGIES
        schedules = {None: DEFAULT_SCHEDULES, "all": PIPELINE_SCHEDULES}.get(args.pipeline_schedule,
                                                                           (args.pipeline_schedule,))
        rows = rank_layouts(cfg.model, args.num_gpus, gpu, batch, seq, args.gpus_per_node, sw, strategies, schedules)
        if not rows:
            raise UsageError(f"no valid layout of {args.config} on {args.num_gpus} GPUs with global batch {batch}: "
                             "try a global batch divisible by more data-parallel sizes, or another --num-gpus")
    plan = _plan(args, cfg, rows[0], batch, seq) if (args.tokens or args.chinchilla) else None
    shown = rows[:max(1, args.top)]
    if args.json:
        out = [dict(e.to_dict(), calibrated=calibrated(cfg.model), **({"plan": plan} if plan and i == 0 else {}))
               for i, e in enumerate(shown)]
        print(json.dumps(out, indent=1))
        return _nothing_fits(args, gpu, rows)
    _report(args, cfg, rows, gpu, (batch, seq, precision), schedules if args.tp is None else None, plan)
    return _nothing_fits(args, gpu, rows)


def _moe_summary(model) -> str:
    """' (12.88B activated, 12.75B without the embedding lookup: 8 experts, top 2)' for a mixture of experts, else
    '' (publishers count the lookup or not: engine.flops.activated_params)."""
    if not model.num_experts:
        return ""
    return (f" ({activated_params(model) / 1e9:.2f}B activated, {activated_params(model, embedding=False) / 1e9:.2f}B"
            f" without the embedding lookup: {model.num_experts} experts, top {model.moe_router_topk})")


def _nothing_fits(args, gpu, rows) -> int:
    """0 when a layout fits in memory; else one line on stderr and exit code 1 (the table or JSON is still out)."""
    if any(e.fits for e in rows):
        return 0
    least = min(e.memory.total for e in rows) / GIB
    what = "the given layout of {} does not fit" if args.tp is not None else \
        f"none of the {len(rows)} layouts of {{}} fits"
    fix = ("try --recompute-granularity selective or full, a larger --tp/--pp, or a larger-memory --gpu"
           if args.tp is not None else "add GPUs, lower the batch per GPU, or use a larger-memory --gpu")
    print(f"find_parallelism.py: error: {what.format(args.config)} on {args.num_gpus} x {gpu.name} "
          f"({gpu.memory_gib:.0f} GiB each; {'it' if args.tp is not None else 'the least'} needs {least:.1f} GiB per "
          f"GPU); {fix}", file=sys.stderr)
    return 1


def cli(argv=None) -> int:
    try:
        return main(argv)
    except (UsageError, ConfigError) as e:
        print(f"find_parallelism.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())

"""The start-up summary rank 0 prints: layout, parameters per stage, batch arithmetic, memory, kernels.

The launcher calls `banner` once the model is built; it is the only part of a run that consults the
planner (for the memory estimate of this very layout), so the training loop does not depend on it.
Before that, `report_arguments` prints the resolved arguments in Megatron-LM's layout and keeps them
beside the metrics file.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from engine.metrics import arguments_path
from engine.optim.muon import classify, summary
from engine.optim.newton_schulz import MuonSettings
from engine.parallel import comm, grad_accumulation
from engine.parallel.layers import spec_of
from engine.planner.memory import GIB, memory_per_gpu
from engine.precision import model_dtype, precision_name
from kernels import dispatch


def stage_parameters(chunks, ctx) -> list:
    """Parameters of each pipeline stage, whole tensors (tp shards counted once), the tied embedding's copy
    on the last stage not counted. Collective: every rank calls it (all_gather_object over all ranks)."""
    specs = [spec_of(p) for c in chunks for p in c.parameters()]
    mine = sum(math.prod(s.full_shape) for s in specs if s.copy_of is None)
    per_stage = [0] * ctx.pp_size
    for pp_rank, tp_rank, dp_rank, count in comm.all_gather_object((ctx.pp_rank, ctx.tp_rank, ctx.dp_rank, mine)):
        if tp_rank == 0 and dp_rank == 0:
            per_stage[pp_rank] = count
    return per_stage


def memory_estimate(cfg, ctx, global_batch: int, attention: str):
    """engine.planner.memory's estimate for this run's layout (the busiest pipeline stage)."""
    par, m, layout = cfg.parallel, cfg.model, ctx.layout
    microbatches = global_batch // (layout.micro_batch_size * layout.dp)
    tr = cfg.training
    return memory_per_gpu(m, layout, m.seq_length, microbatches, precision_name(cfg),
                          flash_attention=attention != "local", overlap_grad_reduce=par.overlap_grad_reduce,
                          overlap_param_gather=par.overlap_param_gather, optimizer=cfg.optim.optimizer,
                          fp8_param_gather=tr.fp8_param_gather, fp8=tr.fp8_recipe if tr.fp8_format else None,
                          fp8_output_layer=tr.fp8_output_layer)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2 ** 20:.2f} MiB"


def _schedule_and_sharding(layout) -> str:
    """What runs the pipeline and what the replicas shard, named as the flags name them."""
    out = ""
    if layout.pp > 1:
        out += f", pipeline schedule {layout.pipeline_schedule} ({layout.vpp} model chunk{'s' * (layout.vpp > 1)} " \
               "per rank)"
    if layout.shard_group > 1:
        out += f", data-parallel sharding {layout.sharding_strategy}"
    return out


def _memory_line(mem, precision: str, cuda: bool) -> str:
    """The planner's estimate; a CPU process has no CUDA context to reserve for."""
    parts = (f"{_size(mem.allocated)} allocated (weights {_size(mem.weights)}, grads {_size(mem.grads)}, optimizer "
             f"{_size(mem.optimizer)}, activations {_size(mem.activations)}, logits {_size(mem.logits)}"
             + (f", FP8 gather codes and payloads {_size(mem.fp8_gather)}" if mem.fp8_gather else "")
             + (f", FP8 weights held for the step {_size(mem.fp8_held)}" if mem.fp8_held else "") + ")")
    if cuda:
        return (f"memory per GPU (estimate, busiest stage {mem.rank}, {precision}): {_size(mem.total)} = {parts} "
                "+ allocator slack and the CUDA-context reserve")
    return f"memory per process (estimate, busiest stage {mem.rank}, {precision}): {parts}"


def _documents_line(data) -> list:
    """How packed documents change attention and its FLOP count (the log line's TFLOP/s and MFU), if they do."""
    if not (data.reset_attention_mask or data.reset_position_ids):
        return []
    what = [w for flag, w in ((data.reset_attention_mask, "attention within each document"),
                              (data.reset_position_ids, "positions restarting with each")) if flag]
    count = ("; TFLOP/s and MFU count attention as the sum of L_i^2 over each sample's documents, from the "
             "documents each step holds") if data.reset_attention_mask else ""
    return [f"packed documents (ended by the end-of-document token): {' and '.join(what)}{count}"]


def optimizer_lines(cfg, ctx, chunks) -> list:
    """What trains which parameter: AdamW's settings, or what Muon takes (with its settings) and every parameter
    the scalar optimizer takes, with why (engine.optim.muon.summary). Collective under Muon (the parameters of
    every stage are gathered): every rank calls it."""
    o = cfg.optim
    decoupled = [] if o.decoupled_lr is None else [
        f"  the word embedding and output layer on their own LR schedule: --decoupled-lr {o.decoupled_lr:g} down to "
        f"{o.decoupled_floor():g} (the others: --lr {o.lr:g} down to {o.min_lr:g})"]
    if o.optimizer == "adam":
        return [f"optimizer: adam (AdamW: betas ({o.adam_beta1}, {o.adam_beta2}), eps {o.adam_eps:g}, decoupled weight "
                f"decay {o.weight_decay:g} on the 2-D parameters)"] + decoupled
    mine = [(name, spec_of(p).full_shape, classify(name, p)) for c in chunks for name, p in c.named_parameters()
            if p.requires_grad and spec_of(p).copy_of is None]
    named = {}
    for part in comm.all_gather_object(mine):
        named.update({name: (name, shape, why) for name, shape, why in part})
    lines = summary(list(named.values()), MuonSettings.of(o))
    if ctx.tp_size > 1 and o.muon_tp_mode == "blockwise":
        lines.append(f"  --muon-tp-mode blockwise: each of the {ctx.tp_size} tp ranks orthogonalises its own shard of "
                     "a tp-split matrix, so the updates (and the loss curve) depend on tp; duplicated or distributed "
                     "orthogonalise whole matrices")
    return lines + decoupled


def fp8_lines(cfg) -> list:
    """What runs in FP8 and what MFU is measured against (nothing without --fp8-format)."""
    tr = cfg.training
    if tr.fp8_format is None:
        return []
    scaling = {"tensorwise": "each tensor's current amax", "blockwise": "1x128 activation / 128x128 weight tiles",
               "delayed": f"amax history of {tr.fp8_amax_history_len} steps ({tr.fp8_amax_compute_algo})"}
    return [f"fp8: {tr.fp8_format} ({'e4m3 forward, e5m2 gradients' if tr.fp8_format == 'hybrid' else 'e4m3'}), "
            f"{tr.fp8_recipe} scaling ({scaling[tr.fp8_recipe]}, margin {tr.fp8_margin}) in the QKV, projection, MLP"
            + (", expert and output layer GEMMs (--fp8-output-layer); the attention core" if tr.fp8_output_layer
               else " and expert GEMMs; the output layer, attention core")
            + f" and the rest in {precision_name(cfg)}; MFU is "
            "against the dense bf16 peak (--peak-tflops), the FP8 peak being twice it"
            + ("; the sharded weights' all-gathers move the FP8 linears' and routed experts' weights as FP8 codes "
               "(--fp8-param-gather)" if tr.fp8_param_gather else "")]


def banner(cfg, ctx, chunks, device, layout: str) -> str:
    """Start-up summary (rank 0 prints it): layout, parameters per stage, batch arithmetic, memory, kernels.

    Collective (the per-stage parameter count is gathered from every rank): every rank calls it.
    """
    per_stage = stage_parameters(chunks, ctx)
    tr, gbs = cfg.training, cfg.training.global_batch_size  # cfg is resolved (engine.resolve.resolve)
    accum = gbs // (tr.micro_batch_size * ctx.dp_size)
    # Attention as the layers resolved it: for the run's dropout and parameter dtype.
    kernels = dispatch.kernel_report(torch.device(device), cfg.model.attention_backend, cfg.model.attention_dropout,
                                     model_dtype(cfg))
    mem = memory_estimate(cfg, ctx, gbs, kernels["attention"])
    kernels["gradient_accumulation_fusion"] = grad_accumulation.describe(tr.gradient_accumulation_fusion,
                                                                         torch.device(device), model_dtype(cfg))
    if ctx.cp_size > 1:  # the blocks ring attention merges by their log-sum-exp (engine.parallel.ring_attention)
        kernels["context_parallel_attention_blocks"] = dispatch.attention_block_backend(kernels["attention"], device)
    ramp = f" (ramp-up: {' '.join(map(str, tr.rampup_batch_size))})" if tr.rampup_batch_size else ""
    stages = ", ".join(f"stage {i}: {n:,}" for i, n in enumerate(per_stage))
    cp = f" x cp {ctx.cp_size} ({ctx.cp_comm_type})" if ctx.cp_size > 1 else ""
    ep = f" (ep {ctx.ep_size}: {cfg.model.num_experts // ctx.ep_size} of {cfg.model.num_experts} experts per rank)" \
        if cfg.model.num_experts else ""
    lines = [f"Ternion: world {ctx.world_size} = tp {ctx.tp_size}{cp} x pp {ctx.pp_size} x dp {ctx.dp_size}{ep}, "
             f"sequence parallel {ctx.sequence_parallel}{_schedule_and_sharding(ctx.layout)}",
             layout,
             f"parameters: {sum(per_stage):,} in total; per pipeline stage: {stages}",
             f"batch: micro {tr.micro_batch_size} x dp {ctx.dp_size} x accumulation {accum} = global "
             f"{gbs}{ramp}; {gbs * cfg.model.seq_length:,} tokens per iteration",
             _memory_line(mem, precision_name(cfg), torch.device(device).type == "cuda"),
             *optimizer_lines(cfg, ctx, chunks),
             *fp8_lines(cfg),
             f"kernels: {json.dumps(kernels)}",
             *_documents_line(cfg.data),
             f"device: {device}" + (f", {torch.get_num_threads()} CPU threads per process"
                                   if torch.device(device).type == "cpu" else "")]
    return "\n".join(lines)


ARGUMENTS_RULE = "------------------------ arguments ------------------------"
ARGUMENTS_END = "-------------------- end of arguments ---------------------"


def resolved_arguments(cfg) -> dict:
    """Every flag's value after resolution (engine.resolve.resolve), by its name with underscores, sorted.

    These are exactly the keys a --config file takes, so the saved copy (`report_arguments`) runs again as
    `--config FILE` (JSON is YAML). A vocabulary the resolution grew (NullTokenizer's end-of-document id)
    is saved as given, so that resolving the file again grows it once."""
    args = dict(sorted((name, value) for section in cfg.to_dict().values() for name, value in section.items()))
    if getattr(cfg, "given_vocab_size", None) is not None:
        args["vocab_size"] = cfg.given_vocab_size
    return args


def arguments_text(arguments: dict) -> str:
    """Megatron-LM's printout: a rule, then `  name ........ value` per argument (in the given order), a rule."""
    lines = [f"  {name} {'.' * max(48 - len(name), 3)} {value}" for name, value in arguments.items()]
    return "\n".join([ARGUMENTS_RULE, *lines, ARGUMENTS_END])


def report_arguments(cfg, rank: int, log=print) -> Optional[str]:
    """Once at start, on rank 0: print the resolved arguments and save them as JSON beside the metrics file
    (engine.metrics.arguments_path: `<metrics file without its extension>.args.json`). Not collective.

    Returns the file's path (None on other ranks, or when the run has no metrics file)."""
    if rank != 0:
        return None
    arguments = resolved_arguments(cfg)
    path = arguments_path(cfg)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(arguments, fh, indent=1)
            fh.write("\n")
    log(arguments_text(arguments) + (f"\narguments saved to {path} (runs again as --config {path})" if path else ""))
    return path

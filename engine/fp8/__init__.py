"""FP8 training (Megatron-LM's recipes): which GEMMs run in FP8, and the per-step life of their scales.

`attach` gives every column- and row-parallel linear of a model chunk (QKV, projection, MLP) an
`Fp8Linear`, the routed experts an `Fp8Experts`, and a SwiGLU MLP without biases under tensor scaling an
`Fp8SwiGLU` over its two linears (engine.fp8.mlp: SwiGLU's tensors made as FP8 codes); the router stays in the
run's precision, and so does the output layer, as in Megatron-LM, unless `--fp8-output-layer` gives it an
`Fp8Linear` too (`head_fp8`, a column-parallel linear over the vocabulary: named `output_layer` in checkpoints,
held for the schedule like the others; its weight, the tied embedding's where tied, is gathered in the run's
precision, which the embedding's lookup reads). `finish_step` ends a step of delayed scaling: every
tensor's amax of the step is reduced over the pipeline stage's ranks (tp x cp, then dp x cp) in one all-reduce
each and pushed into its history. `state_dict`/`load_state_dict` carry the histories in checkpoints, keyed by
layer name (global layer numbers), so they reshard to any layout. `weights_held` spans a step's forward/backward
schedule: each linear and each routed expert has its weight quantized once for all the schedule's microbatches
(engine.fp8.linear, `Held`; engine.fp8.experts).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from engine.fp8.experts import Fp8Experts
from engine.fp8.linear import Fp8Linear
from engine.fp8.mlp import Fp8SwiGLU, fusable
from engine.fp8.scaling import Recipe, push_all
from engine.moe.experts import Experts
from engine.parallel import comm
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

ROLES = ("input", "weight", "grad")


OUTPUT_LAYER = "output_layer"  # the output layer's Fp8Linear's name (checkpoints; Megatron-LM's module name)


def attach(chunk, recipe: Optional[Recipe], ctx, output_layer: bool = False) -> None:
    """Give the chunk's hidden linears and experts their FP8 GEMMs (nothing when `recipe` is None); `output_layer`
    (--fp8-output-layer): the output layer's too, where the chunk has it."""
    if recipe is None:
        return
    if output_layer and chunk.post_process:
        chunk.head_fp8 = Fp8Linear(recipe, chunk.output_weight(), ctx)
    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8 = Fp8Linear(recipe, module.weight, ctx)
        elif isinstance(module, Experts):
            module.fp8 = Fp8Experts(recipe, may_hold=not ctx.layout.sharding.params)
    for module in chunk.modules():
        if fusable(module):
            module.fp8 = Fp8SwiGLU(module.fc1.fp8, module.fc2.fp8)


def experts(chunks) -> list:
    """The Fp8Experts over this rank's chunks."""
    return [m.fp8 for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Experts)]


def linears(chunks) -> dict:
    """name -> Fp8Linear over this rank's chunks, in one order on every rank of a stage (the output layer's last)."""
    out = {name: m.fp8 for chunk in chunks for name, m in chunk.named_modules()
           if isinstance(getattr(m, "fp8", None), Fp8Linear)}
    for chunk in chunks:
        if getattr(chunk, "head_fp8", None) is not None:
            out[OUTPUT_LAYER] = chunk.head_fp8
    return out


def keepers(chunks) -> list:
    """The chunks' FP8 linears and experts: what `weights_held` may keep quantized weights in (found once, by the
    pipeline runner; none without FP8)."""
    return [*linears(chunks).values(), *experts(chunks)]


@contextlib.contextmanager
def weights_held(found: list, microbatches: int):
    """Within it (one schedule of `microbatches` on this rank) every FP8 linear's and experts' weight of `found`
    (`keepers`) that may be kept (not under ZeRO-3) is quantized once and reused; after it the codes are dropped,
    so nothing outlives the schedule (the optimizer step changes the weights next). A single microbatch has
    nothing to reuse: nothing is held then."""
    held = [k for k in found if k.may_hold] if microbatches > 1 else []
    for k in held:
        k.hold(True)
    try:
        yield
    finally:
        for k in held:
            k.hold(False)


def delayed(chunks) -> bool:
    return any(lin.recipe.delayed for lin in linears(chunks).values())


def finish_step(chunks, ctx) -> None:
    """Delayed scaling: the step's amaxes, reduced over the stage (tp, cp, dp), enter the histories."""
    found = [getattr(lin, role) for lin in linears(chunks).values() for role in ROLES]
    if not found or not found[0].recipe.delayed:
        return
    step = torch.stack([s.seen for s in found])
    for group, size in ((ctx.tp_cp_group, ctx.tp_size * ctx.cp_size), (ctx.dp_cp_group, ctx.dp_cp_size)):
        if size > 1:
            comm.all_reduce(step, group, op=comm.ReduceOp.MAX)
    push_all(found, step)


def state_dict(chunks) -> dict:
    """'<linear>.<role>' -> {'history', 'steps'} for this rank's linears (the same on every rank of a stage)."""
    return {f"{name}.{role}": getattr(lin, role).state() for name, lin in linears(chunks).items() for role in ROLES}


def load_state_dict(chunks, state: dict) -> None:
    for name, lin in linears(chunks).items():
        for role in ROLES:
            if f"{name}.{role}" in state:
                getattr(lin, role).load(state[f"{name}.{role}"])

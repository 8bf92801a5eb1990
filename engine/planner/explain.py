"""Why the planner's pick beat the runner-up, in one line with the step-time terms of both.

The runner-up is the fastest other layout that fits with other parallel degrees (tp, cp, pp, dp or ep): the next
few rows often differ only in virtual stages, micro batch or sharding strategy, within a fraction of a percent, and
would say nothing about why this split of the GPUs. Without one, the next fitting layout."""
from __future__ import annotations

from typing import Optional

from engine.layout import Layout
from engine.planner.memory import GIB
from engine.planner.step_time import Estimate

# The terms a step is the sum of (engine/planner/step_time.py), then the exposed parts of compute worth naming.
STEP_TERMS = (("compute", "compute"), ("bubble", "bubble"), ("dp_comm", "dp exchange"), ("optimizer", "optimizer"),
              ("muon", "Muon"))
WITHIN_COMPUTE = (("cp_comm", "cp exchange"), ("ep_comm", "ep all-to-all"))


def describe(lay: Layout) -> str:
    """'tp 2 x cp 4 x pp 4 (vpp 4, interleaved) x dp 2, mb 1, SP, optim_grads, no recomputation'."""
    sizes = [f"tp {lay.tp}"] + ([f"cp {lay.cp}"] if lay.cp > 1 else []) + [f"pp {lay.pp}"]
    if lay.pp > 1:
        split = (f"{lay.first_stage_layers}/../{lay.last_stage_layers} layers" if lay.first_stage_layers is not None
                 else f"vpp {lay.vpp}")
        sizes[-1] += f" ({split}, {lay.schedule.name})"
    sizes.append(f"dp {lay.dp}" + (f" (ep {lay.ep})" if lay.ep > 1 else ""))
    extras = [f"mb {lay.micro_batch_size}"] + (["SP"] if lay.sequence_parallel else [])
    extras += [lay.sharding_strategy, "no recomputation" if lay.recompute == "none" else f"{lay.recompute} recomputation"]
    return " x ".join(sizes) + ", " + ", ".join(extras)


def _degrees(lay: Layout) -> tuple:
    return lay.tp, lay.cp, lay.pp, lay.dp, lay.ep


def runner_up(ranked: list) -> Optional[Estimate]:
    """The fastest fitting layout after ranked[0] with other degrees (else the next fitting one, else None)."""
    others = [e for e in ranked[1:] if e.fits]
    best = _degrees(ranked[0].layout)
    return next((e for e in others if _degrees(e.layout) != best), others[0] if others else None)


def why(best: Estimate, second: Estimate) -> str:
    """One line: both layouts, their step times and each term of them, and their memory."""
    gain = (second.step_time_s - best.step_time_s) / second.step_time_s
    terms = [(name, best.breakdown.get(key, 0.0), second.breakdown.get(key, 0.0))
             for key, name in STEP_TERMS + WITHIN_COMPUTE]
    shown = ", ".join(f"{name} {a:.3f} vs {b:.3f}" for name, a, b in terms if a or b)
    return (f"picked {describe(best.layout)} over the runner-up {describe(second.layout)}: "
            f"{best.step_time_s:.3f} s vs {second.step_time_s:.3f} s a step ({gain:.1%} less; {shown} s), "
            f"{best.memory.total / GIB:.1f} vs {second.memory.total / GIB:.1f} GiB per GPU")

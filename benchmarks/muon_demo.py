"""Muon against AdamW on the demo corpus: does a tiny Llama reach AdamW's 300-step loss in fewer steps?

    python -m benchmarks.muon_demo [--iters 300] [--out .cache/muon_demo] [--plot docs/muon_vs_adamw.png]

The corpus is `make demo`'s (the Python standard library's sources, a 2048-piece SentencePiece tokenizer; built
once into .cache/demo). The model is configs/gpt-tiny.yaml's Llama shape (4 layers, hidden 64, 4 heads in 2
query groups, SwiGLU, RMSNorm, RoPE, tied embeddings; 16 sequences of 64 tokens per step), trained by
launch/pretrain_gpt.py as one CPU process from the same weights on the same batches, with a cosine schedule
(10 warm-up steps, down to a tenth of the peak) and clipping at 1.0. Each optimizer runs at every learning rate
of its grid, and its best (lowest mean training loss over the last 20 steps) is kept:
- adam: AdamW (betas 0.9, 0.999; weight decay 0.01);
- muon: Megatron-LM's defaults (quintic Newton-Schulz in bf16, spectral scale, no Nesterov) but momentum 0.95
  (torch.optim.Muon's; Megatron-LM's is 0.9), with
  --muon-extra-scale-factor 0.2, the factor that gives its updates AdamW's size (Liu et al. 2025, "Muon is
  scalable"), so that one --lr also serves the embedding and norms, which AdamW trains under Muon.
The target is the tuned AdamW's loss at the last step (mean of its last 20 steps); the answer is the first step
at which the tuned Muon's 20-step mean reaches it (or that it does not). Held-out loss at the end is reported
beside it. Results: the table printed, every run's metrics file in --out, the runs' final losses and the answer
in benchmarks/results/muon_demo.json, and the curves drawn for the README and docs/design.md (--plot).
"""
from __future__ import annotations

import json
import os
import sys

from benchmarks import demo_runs
from benchmarks.demo_runs import ROOT, WINDOW, smooth

# Learning rates a factor sqrt(2) apart around each optimizer's best (a coarser first sweep: AdamW 1e-3 to 1.6e-2,
# best 8e-3; Muon 2e-3 to 3.2e-2, best 1.6e-2).
GRIDS = {"adam": (2e-3, 2.8e-3, 4e-3, 5.7e-3, 8e-3, 1.1e-2, 1.6e-2),
         "muon": (4e-3, 5.7e-3, 8e-3, 1.1e-2, 1.6e-2, 2.3e-2, 3.2e-2)}
FLAGS = {"adam": [], "muon": ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-extra-scale-factor", "0.2"]}


def train(optimizer: str, lr: float, iters: int, data: tuple, out: str) -> dict:
    """One launcher run; its per-step training losses and final held-out loss, from its metrics file."""
    run = demo_runs.train(f"muon_demo: {optimizer} at lr {lr:g}", lr, iters, data,
                          os.path.join(out, f"{optimizer}-lr{lr:g}.jsonl"), FLAGS[optimizer])
    return {"optimizer": optimizer, "lr": lr, **run}


def compare(runs: list) -> dict:
    """The tuned run of each optimizer, AdamW's final loss as the target and Muon's first step reaching it."""
    best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["final"]) for o in GRIDS}
    target = best["adam"]["final"]
    reached = next((i + 1 for i, loss in enumerate(smooth(best["muon"]["curve"])) if loss <= target), None)
    edges = {o: best[o]["lr"] in (GRIDS[o][0], GRIDS[o][-1]) for o in GRIDS}
    return {"best": {o: {k: best[o][k] for k in ("lr", "final", "valid")} for o in GRIDS}, "target": target,
            "muon_steps_to_target": reached, "iters": len(best["adam"]["curve"]), "best_at_grid_edge": edges}


def plot(runs: list, result: dict, path: str) -> None:
    """Every run's smoothed curve (the tuned ones bold), AdamW's final loss and the step Muon reaches it."""
    fig, ax = demo_runs.new_figure()
    for o, colour in (("adam", "tab:blue"), ("muon", "tab:red")):
        for r in (r for r in runs if r["optimizer"] == o):
            tuned = r["lr"] == result["best"][o]["lr"]
            ax.plot(range(1, len(r["curve"]) + 1), smooth(r["curve"]), color=colour, alpha=1 if tuned else 0.18,
                    lw=1.8 if tuned else 0.8, label=f"{'AdamW' if o == 'adam' else 'Muon'} lr {r['lr']:g}" if tuned
                    else None)
    ax.axhline(result["target"], color="gray", ls="--", lw=0.8, label="AdamW's final loss")
    if result["muon_steps_to_target"]:
        ax.axvline(result["muon_steps_to_target"], color="tab:red", ls=":", lw=0.8,
                   label=f"Muon reaches it at step {result['muon_steps_to_target']}")
    demo_runs.save_figure(fig, ax, (result["target"] - 0.6, result["target"] + 2.5),
                          "tiny Llama on the demo corpus; faint: the other learning rates", path)


def main(argv=None) -> int:
    args = demo_runs.parse_args(__doc__, "muon_demo", "muon_vs_adamw.png", argv)
    data = demo_runs.demo_corpus()
    runs = []
    for optimizer, grid in GRIDS.items():
        for lr in grid:
            runs.append(train(optimizer, lr, args.iters, data, args.out))
            r = runs[-1]
            print(f"{optimizer:5s} lr {lr:<7g} final {WINDOW}-step mean {r['final']:.4f}  held-out {r['valid']:.4f}",
                  flush=True)
    result = compare(runs)
    with open(os.path.join(ROOT, "benchmarks", "results", "muon_demo.json"), "w") as fh:
        json.dump({"result": result, "runs": [{k: r[k] for k in ("optimizer", "lr", "final", "valid")} for r in runs]},
                  fh, indent=1)
    plot(runs, result, args.plot)
    b, steps = result["best"], result["muon_steps_to_target"]
    print(f"tuned: AdamW lr {b['adam']['lr']:g} -> {b['adam']['final']:.4f} (held-out {b['adam']['valid']:.4f}); "
          f"Muon lr {b['muon']['lr']:g} -> {b['muon']['final']:.4f} (held-out {b['muon']['valid']:.4f})")
    print(f"Muon reaches AdamW's {result['iters']}-step loss {result['target']:.4f} "
          + (f"at step {steps} ({steps / result['iters']:.0%} of the steps)" if steps else "in none of its steps"))
    if any(result["best_at_grid_edge"].values()):
        print(f"note: a tuned learning rate is at its grid's edge: {result['best_at_grid_edge']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

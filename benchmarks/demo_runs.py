"""What the demo-corpus comparisons (benchmarks/muon_demo.py, benchmarks/fp8_demo.py) share.

Both train configs/gpt-tiny.yaml's Llama shape with launch/pretrain_gpt.py, one CPU process per run, on
`make demo`'s corpus from the same weights on the same batches, then compare loss curves smoothed over the
last WINDOW steps and draw them. This module holds the corpus, the command line, one launcher run and the
figure's frame; each demo keeps its own runs, comparison and legend.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

from tools.demo_corpus import build_demo_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 20  # steps a smoothed training loss averages


def parse_args(doc: str, name: str, plot: str, argv=None) -> argparse.Namespace:
    """The demos' shared command line (--iters, --out, --plot), with --out created."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(ROOT, ".cache", name))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", plot))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return args


def demo_corpus() -> tuple:
    """`make demo`'s corpus (tokenizer model, dataset prefix), built once into .cache/demo."""
    return build_demo_corpus(os.path.join(ROOT, ".cache", "demo"), vocab_size=2048, max_files=400)


def train(label: str, lr: float, iters: int, data: tuple, metrics: str, flags: list) -> dict:
    """One launcher run at peak `lr` with the extra `flags`; its per-step training losses ("curve"), their
    smoothed last value ("final") and the final held-out loss ("valid"), from its metrics file. A failed run
    ends the demo with its output, naming it by `label`."""
    if os.path.exists(metrics):
        os.remove(metrics)
    tokenizer, prefix = data
    cmd = [sys.executable, "launch/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml", "--device", "cpu",
           "--data-path", prefix, "--tokenizer-model", tokenizer, "--split", "98,2,0", "--train-iters", str(iters),
           "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-warmup-iters", "10", "--lr-decay-iters", str(iters),
           "--eval-interval", str(iters), "--eval-iters", "16", "--log-interval", str(iters // 6),
           "--metrics-file", metrics, *flags]
    # A port of its own: a one-process launch otherwise listens on the launcher's default, which a test or
    # another run on this machine may hold. PYTHONPATH: this checkout's engine, whichever one is installed.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()),
               PYTHONPATH=ROOT)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{label} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    curve, valid = read_metrics(metrics)
    return {"curve": curve, "valid": valid, "final": smooth(curve)[-1]}


def read_metrics(path: str) -> tuple:
    """A run's metrics file: its training losses in step order and its last held-out loss."""
    losses, valid = {}, None
    with open(path) as fh:
        for record in map(json.loads, fh):
            if record.get("split") == "valid":
                valid = record["lm_loss"]
            elif "event" not in record and record.get("lm_loss") is not None:
                losses[record["iteration"]] = record["lm_loss"]
    return [losses[i] for i in sorted(losses)], valid


def free_port() -> int:
    """A local TCP port no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smooth(curve: list) -> list:
    """Each step's mean loss over the last WINDOW steps (fewer at the start)."""
    return [sum(curve[max(0, i + 1 - WINDOW):i + 1]) / (i + 1 - max(0, i + 1 - WINDOW)) for i in range(len(curve))]


def new_figure():
    """A (figure, axes) pair for loss curves, drawn off-screen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=(7, 4))


def save_figure(fig, ax, ylim: tuple, title: str, path: str) -> None:
    """Label the axes of smoothed training losses, add the title and legend, and write the figure to `path`."""
    ax.set(xlabel="step", ylabel=f"training loss ({WINDOW}-step mean)", ylim=ylim)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)

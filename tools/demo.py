"""`make demo`: the whole life of a run on whatever machine this is, in a few minutes.

1. a demo corpus from the Python standard library's own sources (no download): tokenizer + indexed data;
2. a tiny Llama-shaped model trained on 8 processes, tp 2 x pp 2 x dp 2, with sequence parallelism and
   the distributed optimizer (cpu + gloo, or cuda + nccl when 8 GPUs are visible), saving checkpoints;
3. a second launch that resumes from the latest checkpoint and trains on;
4. the sharded checkpoint merged into one file, and a few lines of text sampled from it;
5. the loss curve and the pipeline timeline drawn as PNGs.
Everything lands in demo_out/ (the corpus is cached in .cache/demo and reused). The training steps print
what a real run prints: the resolved arguments, the start-up banner, a Megatron-style line every 5
iterations (averaged over them, with a timestamp and an ETA) and a line per checkpoint save.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(cmd: list, **kw) -> None:
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, cwd=ROOT, **kw)
    if result.returncode:
        sys.exit(f"demo: step failed (exit {result.returncode}): {' '.join(cmd)}")


def losses(metrics_file: str) -> dict:
    out = {}
    with open(metrics_file) as fh:
        for line in fh:
            rec = json.loads(line)
            if "lm_loss" in rec and "split" not in rec and "event" not in rec and rec["lm_loss"] is not None:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "demo_out"))
    ap.add_argument("--iters", type=int, default=240, help="total training iterations (half before the resume)")
    args = ap.parse_args()
    import torch
    from demo_corpus import build_demo_corpus

    start = time.time()
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    step("1/5 demo corpus (Python standard library sources; cached after the first run)")
    tokenizer, prefix = build_demo_corpus(os.path.join(ROOT, ".cache", "demo"), vocab_size=2048, max_files=400)
    print(f"tokenizer {tokenizer}\ndata      {prefix}.bin/.idx", flush=True)

    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 8 else "cpu"
    ckpt, tb = os.path.join(out, "checkpoints"), os.path.join(out, "tensorboard")
    half = args.iters // 2
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
             "launch/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml", "--device", device,
             "--data-path", prefix, "--tokenizer-model", tokenizer, "--split", "98,2,0",
             "--tp", "2", "--pp", "2", "--sequence-parallel", "--use-distributed-optimizer",
             "--save", ckpt, "--save-interval", str(max(half // 2, 1)), "--tensorboard-dir", tb,
             "--eval-interval", str(half), "--eval-iters", "2", "--lr-decay-iters", str(args.iters),
             "--log-interval", "5", "--pipeline-trace", os.path.join(out, "trace")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    step(f"2/5 train {half} iterations on 8 {device} processes: tp 2 x pp 2 x dp 2, sequence parallel, "
         f"distributed optimizer")
    run(train + ["--train-iters", str(half)], env=env)
    step(f"3/5 resume from the latest checkpoint and train to iteration {args.iters}")
    run(train + ["--train-iters", str(args.iters)], env=env)

    step("4/5 merge the sharded checkpoint and sample text from it")
    merged = os.path.join(out, "merged")
    run([sys.executable, "tools/merge_ckpt.py", "--load", ckpt, "--out", merged])
    for prompt in ("def ", "import os\n", "class "):
        run([sys.executable, "tools/generate.py", "--load", merged, "--tokenizer-model", tokenizer,
             "--prompt", prompt, "--max-new-tokens", "48", "--top-k", "8", "--temperature", "0.8"])

    step("5/5 loss curve and pipeline timeline")
    metrics = os.path.join(tb, "metrics.jsonl")
    run([sys.executable, "tools/plot_metrics.py", metrics, "--out", os.path.join(out, "loss.png")])
    run([sys.executable, "tools/plot_pipeline.py", os.path.join(out, "trace"), "--out",
         os.path.join(out, "pipeline.png")])

    curve = losses(metrics)
    first, last = curve[min(curve)], curve[max(curve)]
    print(f"\nloss {first:.3f} at iteration {min(curve)} -> {last:.3f} at iteration {max(curve)} "
          f"({'falling' if last < first else 'NOT falling'}); {time.time() - start:.0f} s in all")
    print(f"outputs in {out}: loss.png, pipeline.png, checkpoints/, merged/, tensorboard/ (with metrics.jsonl, one "
          f"record per iteration, and metrics.args.json, the resolved arguments)")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/train.py: the engine and the plain PyTorch loop train the same model on the same batches
(their loss curves agree), and the report holds the figures the README quotes. Budget: about 10 s."""
import json
import os
import subprocess
import sys

import pytest
from harness import NO_DROPOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
         "--seq-length", "32", "--max-position-embeddings", "32"]


def bench(args, timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "benchmarks/train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # two training loops in a subprocess: ~5 s
def test_benchmark_reports_both_loops_on_the_same_work():
    from engine.config import ModelConfig
    from engine.flops import flops_per_iteration
    proc = bench(SMALL + ["--iters", "4", "--warmup", "1", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert len(r["engine"]["losses"]) == len(r["plain"]["losses"]) == 5
    assert r["max_loss_difference"] < 1e-4, (r["engine"]["losses"], r["plain"]["losses"])
    assert r["engine"]["losses"][-1] < r["engine"]["losses"][0], "neither loop learns"
    m = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=32,
                    vocab_size=256, make_vocab_size_divisible_by=16, swiglu=True)
    flops = flops_per_iteration(m, 16, 32)
    for loop in ("engine", "plain"):
        x = r[loop]
        assert x["tokens_per_sec"] == pytest.approx(16 * 32 / x["step_time_s"])
        assert x["tflops"] == pytest.approx(flops / x["step_time_s"] / 1e12)
        assert x["mfu"] == pytest.approx(x["tflops"] / r["peak_tflops"]) and x["mfu"] > 0
    assert r["engine_over_plain"] == pytest.approx(r["engine"]["step_time_s"] / r["plain"]["step_time_s"])
    assert "measured" in r["peak_source"] and r["device"].startswith("CPU")


def test_benchmark_rejects_a_multi_rank_layout_with_one_line():
    proc = bench(SMALL + ["--tp", "2"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("benchmarks/train.py: error: --tp 2 --pp 1:") and proc.stderr.count("\n") == 1

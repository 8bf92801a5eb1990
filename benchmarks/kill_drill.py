"""The kill drill of issue 37: SIGKILL one rank of a cp 2 x dp 2 job, again and again, and time how long the job
takes to end after the kill, and which ranks left a stack file.

    python benchmarks/kill_drill.py [--repeats 20] [--rank 1] [--timeout-minutes 0.25] [--signal KILL|STOP]
                                    [--nproc 4] [--layout "--cp 2"]

Each repetition runs a tiny model under torchrun on 4 CPU ranks (gloo) with --distributed-timeout-minutes T,
SIGKILLs (or SIGSTOPs: frozen, its sockets open) global rank `--rank` once the metrics file reaches iteration 2, and reports per repetition: seconds from
the kill to the job's end, whether that is within T x 60 + BOUND_S, the rank each survivor's line names, and the
stack files under <save>/stacks/ (rank<N>.txt from a rank's failure line, rank<N>.SIGTERM.txt from torchrun
stopping a rank). Prints one line per repetition and a summary; exits 1 if any repetition missed the bound.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_S = 15.0  # beyond the timeout: two heartbeats for the culprit, the stack, torchrun's own reaction
ARGS = ["--config", "configs/gpt-tiny.yaml", "--mock-data", "--num-layers", "4", "--hidden-size", "32",
        "--seq-length", "32", "--max-position-embeddings", "32", "--log-interval", "1", "--train-iters", "100000",
        "--micro-batch-size", "1"]


def _rank_pid(tag: str, rank: int):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(i.decode(errors="replace").split("=", 1) for i in fh.read().split(b"\0") if b"=" in i)
        except OSError:
            continue
        if env.get("KILL_DRILL") == tag and env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return int(pid)
    return None


def _iteration(metrics: str) -> int:
    try:
        with open(metrics) as fh:
            return max((json.loads(line).get("iteration", 0) for line in fh if line.endswith("\n")), default=0)
    except (OSError, ValueError):
        return 0


def once(n: int, rank: int, minutes: float, work: str, sig=signal.SIGKILL, nproc: int = 4,
         layout: tuple = ("--cp", "2")) -> dict:
    save, metrics, tag = os.path.join(work, f"save{n}"), os.path.join(work, f"m{n}.jsonl"), f"drill-{os.getpid()}-{n}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", KILL_DRILL=tag,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", "0", "--monitor-interval", "0.2", "launch/pretrain_gpt.py", *ARGS, *layout, "--save", save,
           "--metrics-file", metrics, "--distributed-timeout-minutes", str(minutes)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and _iteration(metrics) >= 2:
            pid = _rank_pid(tag, rank)
            if pid is not None:
                os.kill(pid, sig)
                killed = time.monotonic()
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate()[0]
    ended = time.monotonic()
    lines = [line for line in out.splitlines() if "collective failed" in line]
    named = sorted({int(m.group(1)) for line in lines for m in [re.search(r"\(rank (\d+) on host", line)] if m})
    folder = os.path.join(save, "stacks")  # an empty rank<N>.SIGTERM.txt is the killed rank's, never written
    stacks = sorted(f for f in os.listdir(folder) if os.path.getsize(os.path.join(folder, f))) \
        if os.path.isdir(folder) else []
    seconds = ended - killed if killed else float("nan")
    ops = sorted({m.group(1) for line in lines for m in [re.search(r"; last collective: (.+?): ", line)] if m})
    return {"seconds": seconds, "within": bool(killed) and seconds <= minutes * 60 + BOUND_S, "named": named,
            "lines": len(lines), "stacks": stacks, "ops": ops}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--timeout-minutes", type=float, default=0.25)
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--layout", default="--cp 2", help="the layout's flags (default: --cp 2, i.e. cp 2 x dp 2 at 4)")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="kill-drill-") as work:
        for n in range(args.repeats):
            r = once(n, args.rank, args.timeout_minutes, work, signal.Signals["SIG" + args.signal], args.nproc,
                     tuple(args.layout.split()))
            results.append(r)
            print(f"{n:2d}: ended {r['seconds']:.1f} s after the kill ({'within' if r['within'] else 'OVER'} "
                  f"{args.timeout_minutes * 60 + BOUND_S:.0f} s); survivors' lines {r['lines']}, naming ranks "
                  f"{r['named']}; failed collectives {r['ops']}; stack files {r['stacks']}", flush=True)
    late = sum(not r["within"] for r in results)
    only_killed = sum(r["named"] == [args.rank] for r in results)
    print(f"{len(results) - late}/{len(results)} within the bound; {only_killed}/{len(results)} named rank "
          f"{args.rank} and only it; max {max(r['seconds'] for r in results):.1f} s")
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())

"""The kill drill of issue 37: SIGKILL one rank of a cp 2 x dp 2 job, again and again, and time how long the job
takes to end after the kill, and which ranks left a stack file.

    python benchmarks/kill_drill.py [--repeats 20] [--rank 1] [--timeout-minutes 0.25] [--signal KILL|STOP]
                                    [--nproc 4] [--layout "--cp 2"]

Each repetition runs a tiny model under torchrun on 4 CPU ranks (gloo) with --distributed-timeout-minutes T,
SIGKILLs (or SIGSTOPs: frozen, its sockets open) global rank `--rank` once the metrics file reaches iteration 2, and reports per repetition: seconds from
the kill to the job's end, whether that is within T x 60 + BOUND_S, the rank each survivor's line names, and the
stack files under <save>/stacks/ (rank<N>.txt from a rank's failure line, rank<N>.SIGTERM.txt from torchrun
stopping a rank). Prints one line per repetition and a summary; exits 1 if any repetition missed the bound.

    python benchmarks/kill_drill.py --long-save [--save-seconds 60] [--grace 90]

instead SIGTERMs torchrun (2 CPU ranks) once the job has a checkpoint, with the save that signal starts slowed
to `--save-seconds` (benchmarks/slow_save.py), twice: under `torchrun --shutdown-timeout G` (the save must
complete and `latest` name it) and under torchrun's default grace of 30 s (SIGKILL cuts the save off; `latest`
must still name the previous complete checkpoint). One line per case; exits 1 if either case did otherwise.
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

from engine.checkpoint.files import list_iterations, read_latest

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


def long_save(work: str, save_s: float, grace) -> dict:
    """SIGTERM torchrun once a checkpoint exists; the signal's save takes `save_s` longer. `grace`: the
    --shutdown-timeout given to torchrun (None: its default)."""
    save = os.path.join(work, f"long-save-{grace}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TERNION_SLOW_SAVE_S=str(save_s),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "0", "--monitor-interval", "0.2", *(["--shutdown-timeout", str(grace)] if grace else []),
           "benchmarks/slow_save.py", *ARGS, "--save", save, "--save-interval", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and read_latest(save) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    before, sent = read_latest(save), time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=max(deadline - sent, 1))[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    stop = re.search(r"stopping at iteration (\d+): signal SIGTERM; checkpoint saved", out)
    saved = re.search(rf"saved checkpoint at iteration {stop.group(1)} in ([\d.]+) s", out) if stop else None
    return {"seconds": time.monotonic() - sent, "before": before, "latest": read_latest(save),
            "complete": list_iterations(save), "stopped": int(stop.group(1)) if stop else None,
            "save_s": float(saved.group(1)) if saved else None, "killed": "forcefully exiting" in out,
            "exits": sorted(re.findall(r"slow_save.py: rank (\d+) exited with code (\S+)", out)),
            "cut": sorted(int(n[5:12]) for n in os.listdir(save) if n.endswith(".tmp")) if os.path.isdir(save) else []}


def long_save_drill(save_s: float, grace: int) -> int:
    """Both cases of --long-save; 1 if either did otherwise than expected."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig
    settable = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kill-drill-") as work:
        for g in ([grace] if settable else []) + [None]:
            r = long_save(work, save_s, g)
            if g:
                ok = r["stopped"] == r["latest"] and not r["killed"] and r["exits"] == [("0", "0"), ("1", "0")]
            else:
                ok = bool(r["killed"] and r["latest"] and r["cut"] and r["cut"][-1] > r["latest"]
                          and r["complete"][-1] == r["latest"] and not r["exits"])
            failed += not ok
            print(f"save slowed by {save_s:g} s, grace {f'{g:g} s (--shutdown-timeout)' if g else '30 s (default)'}: "
                  f"{'as expected' if ok else 'NOT as expected'}; ended {r['seconds']:.1f} s after SIGTERM; latest "
                  f"{r['before']} at the signal, {r['latest']} at the end (complete: {r['complete']}; cut off: "
                  f"{r['cut']}); signal's save {r['save_s']} s; torchrun SIGKILLed workers: {r['killed']}; "
                  f"workers' exit codes {r['exits'] or 'none (killed)'}", flush=True)
    if not settable:
        print("this torch's torchrun has no --shutdown-timeout (torch 2.13 has it): the long-grace case was not run")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--timeout-minutes", type=float, default=0.25)
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--layout", default="--cp 2", help="the layout's flags (default: --cp 2, i.e. cp 2 x dp 2 at 4)")
    p.add_argument("--long-save", action="store_true", help="the pre-emption drill with a long save instead")
    p.add_argument("--save-seconds", type=float, default=60.0, help="--long-save: how much the save is slowed")
    p.add_argument("--grace", type=int, default=90, help="--long-save: torchrun's --shutdown-timeout")
    args = p.parse_args()
    if args.long_save:
        return long_save_drill(args.save_seconds, args.grace)
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

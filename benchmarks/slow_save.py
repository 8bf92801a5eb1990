"""launch/pretrain_gpt.py whose pre-emption save is slowed down: a stand-in for a large model's long save.

    TERNION_SLOW_SAVE_S=60 torchrun [torchrun flags] benchmarks/slow_save.py [pretrain_gpt.py flags]

Once a rank has received a pre-emption signal (SIGTERM, SIGUSR1, SIGINT), it sleeps TERNION_SLOW_SAVE_S seconds
before it writes its files of each checkpoint, so the save the signal starts takes that much longer; the folder
is `iter_N.tmp` all that time and `latest` names the previous checkpoint. The saves before the signal run at
full speed. Each rank also says how it exited (`slow_save.py: rank R exited with code C`): torchrun does not
report its workers' exit codes once it is itself stopped by a signal. The pre-emption drills
(`benchmarks/kill_drill.py --long-save`, tests/test_long_save.py) use it to check what the launcher's grace
between SIGTERM and SIGKILL does to such a save.
"""
import os
import runpy
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELAY_ENV = "TERNION_SLOW_SAVE_S"


def slow_down(seconds: float) -> None:
    """Every save that starts writing after this rank's pre-emption handler saw a signal sleeps `seconds` first."""
    from engine.checkpoint.saver import PendingSave
    from engine.run.preemption import PreemptionHandler
    signalled, write, on_signal = threading.Event(), PendingSave.write_shards, PreemptionHandler._on_signal

    def noting(self, signum, frame):
        on_signal(self, signum, frame)
        signalled.set()

    def slow_write(self):
        if signalled.is_set():
            time.sleep(seconds)
        write(self)
    PreemptionHandler._on_signal, PendingSave.write_shards = noting, slow_write


def main() -> None:
    rank = os.environ.get("RANK", "0")
    delay = float(os.environ.get(DELAY_ENV, "0"))
    if delay > 0:
        slow_down(delay)
        if rank == "0":
            print(f"slow_save.py: a save after a pre-emption signal is slowed by {delay:g} s", flush=True)
    sys.argv[0] = os.path.join(ROOT, "launch", "pretrain_gpt.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        print(f"slow_save.py: rank {rank} exited with code {e.code}", flush=True)
        raise


if __name__ == "__main__":
    main()

"""Naming the culprit (issue 37), on one process with a dict for the job's store and threads for the other ranks'
heartbeats: the reporter keeps beating while it reports, survivors that reported (and whose heartbeat then
stopped) are never suspects, the rank that stopped first is named first with its host, a frozen (SIGSTOPped) rank
is named like a dead one; the failure line names the last collective's real group, the failing rank writes its
stack where it says, and SIGTERM writes a blocked rank's stack. About 3 s.
"""
import json
import socket
import threading
import time
from types import SimpleNamespace

from engine.run.guard import Guard
from engine.run.liveness import _KEY, Liveness
from engine.run.phase import Phase

BEAT = 0.05


class DictStore:
    def __init__(self):
        self.d, self.lock = {}, threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self.lock:
            return self.d[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.d for k in keys)


def _beating(store, rank, stop_at, phase="forward/backward schedule of iteration 7 (pp group [0, 1])"):
    """A rank's heartbeat until time `stop_at` (then it dies, or freezes: the same to its peers)."""
    def run():
        while time.time() < stop_at:
            store.set(_KEY.format(rank), json.dumps({"t": time.time(), "phase": phase, "host": f"node{rank}"}))
            time.sleep(BEAT)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_first_rank_to_stop_is_named_and_survivors_that_reported_are_not():
    store, now = DictStore(), time.time()
    _beating(store, 1, now + 10)           # alive, still blocked in the collective
    _beating(store, 2, now + 0.1)          # killed first
    _beating(store, 3, now + 0.3)          # a survivor: it reports, then exits, its heartbeat stops
    other = Liveness(store, 3, 5, lambda: "x", interval=BEAT)
    _beating(store, 4, now + 0.35)         # a second casualty, later
    time.sleep(0.5)
    other.store.set("ternion/liveness/reporter/3", "1")
    me = Liveness(store, 0, 5, lambda: "forward/backward schedule of iteration 7", interval=BEAT).start()
    words = me.culprits()
    assert words.startswith("rank 2 on host node2 stopped answering "), words
    assert "then rank 4" in words and "rank 3" not in words and "rank 1" not in words, words
    # the reporter's own heartbeat kept moving while it reported: another reporter does not suspect it
    t0 = json.loads(store.get(_KEY.format(0)))["t"]
    time.sleep(3 * BEAT)
    assert json.loads(store.get(_KEY.format(0)))["t"] > t0
    me.stop()


def test_two_survivors_reporting_at_once_name_only_the_dead_rank():
    store, now = DictStore(), time.time()
    _beating(store, 2, now + 0.05)
    time.sleep(0.2)
    ranks = [Liveness(store, r, 3, lambda: "optimizer step", interval=BEAT).start() for r in (0, 1)]
    found = [None, None]
    threads = [threading.Thread(target=lambda i=i: found.__setitem__(i, ranks[i].culprits())) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.startswith("rank 2 on host node2 stopped answering") and "rank 0" not in f and "rank 1" not in f
               for f in found), found
    for r in ranks:
        r.stop()


def _ctx():
    return SimpleNamespace(rank=0, tp_ranks=[0, 1], cp_ranks=[0, 2], dp_ranks=[0, 4], dp_cp_ranks=[0, 2, 4, 6],
                           ep_ranks=[0, 4], pp_ranks=[0, 8])


def test_the_last_collective_is_named_with_its_real_group():
    phase = Phase(_ctx(), "optimizer step of iteration 3 (tp group [0, 1])")
    assert phase.group_of("all_gather", [0, 2, 4, 6]) == "all_gather over the dp_cp group [0, 2, 4, 6]"
    assert phase.group_of("all_to_all", [0, 4]) == "all_to_all over the dp group [0, 4]"  # dp first when ep = dp
    assert phase.group_of("send/recv", [0, 8]) == "pp send/recv with rank 8"
    assert phase.group_of("send/recv", [0, 2]) == "cp send/recv with rank 2"  # the context-parallel ring
    assert phase.group_of("all_reduce", [0, 1, 2, 3]) == "all_reduce over ranks [0, 1, 2, 3]"


def test_a_failing_rank_writes_its_stack_into_the_log_dir_and_says_where(tmp_path):
    guard = Guard(3, 1.0)
    guard.log_dir = str(tmp_path)
    said = guard._write_stack()
    path = tmp_path / "stacks" / "rank3.txt"
    assert said == f"; stack in {path}" and "test_a_failing_rank_writes_its_stack" in path.read_text()
    assert socket.gethostname()  # the heartbeat's host comes from here


def test_a_failed_save_is_one_line_from_rank_0_without_a_traceback(capsys):
    from engine.checkpoint.saver import SaveFailed
    error = SaveFailed("saving checkpoint iteration 4 to /ckpt failed on rank 1: OSError: [Errno 28] No space left "
                       "on device")
    assert Guard(1, 1.0).save_failed(error) == 1 and capsys.readouterr().err == ""
    assert Guard(0, 1.0).save_failed(error) == 1
    assert capsys.readouterr().err == (
        "pretrain_gpt.py: error: saving checkpoint iteration 4 to /ckpt failed on rank 1: OSError: [Errno 28] No "
        "space left on device; the previous checkpoint stays the latest; free space or fix --save, then run the same "
        "command to resume\n")


SIGTERM_SCRIPT = """
import signal, sys, time
from engine.run.guard import Guard
guard = Guard(2, 1.0)
guard.log_dir = sys.argv[1]
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # the pre-emption handler, installed first
guard.stacks_on_signal(signal.SIGTERM)
def blocked_in_a_collective():  # until the handler has run (the launcher's SIGTERM, sent from outside)
    deadline = time.monotonic() + (30.0 if sys.argv[2] == "signal" else 0.2)
    print("ready", flush=True)  # from in here: a signal right after it finds this frame on the stack
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
blocked_in_a_collective()
guard.release()
print("handler ran" if got else "no signal")
"""


def _sigterm_script(tmp_path, mode: str) -> tuple:
    """Run SIGTERM_SCRIPT; with mode "signal" send it SIGTERM from this process once it is waiting (as torchrun
    does: a signal raised from a thread of the process itself raced faulthandler's dump of that exiting thread).
    (returncode, stdout after "ready", stderr)"""
    import os
    import signal
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        if mode == "signal":
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out.strip(), err


def test_sigterm_writes_the_stack_of_a_blocked_rank_and_still_runs_the_preemption_handler(tmp_path):
    path = tmp_path / "stacks" / "rank2.SIGTERM.txt"
    code, out, err = _sigterm_script(tmp_path, "signal")
    assert (code, out) == (0, "handler ran"), (code, err)
    assert "blocked_in_a_collective" in path.read_text()
    path.unlink()
    code, out, err = _sigterm_script(tmp_path, "none")
    assert (code, out) == (0, "no signal") and not path.exists(), (code, err)  # no signal: no empty file left

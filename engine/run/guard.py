"""How the launcher ends a rank: a user's mistake, a failed collective, any other failure, a restart.

A mistake is one line from rank 0 and exit 2 (`fail`). Once the process groups exist, a collective that
fails (a peer died, or stalled past --distributed-timeout-minutes, after which gloo raises inside the
collective) ends this rank with one line naming the operation and its group and exit code 1, at once and
without the teardown barrier, so no rank waits on a dead peer and torchrun (--max-restarts) can restart
the job, which then resumes from the latest checkpoint. Any other exception is printed with its traceback
and ends the rank the same way (`Guard.die`). Each restart attempt rendezvouses under its own key prefix
(`restart_store`). Rank 0's lock on --save is given back however the process ends, os._exit included,
because os._exit runs no finalizer.
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback
from typing import NoReturn, Optional

from engine.run.liveness import Liveness
from engine.run.lock import RunLock

_WAIT_FOR_RANK0_S = 30.0
_COLLECTIVE_MARKERS = ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out",
                       "Broken pipe")


def fail(message: str, rank: int, before_groups: bool = False) -> int:
    """Rank 0 prints the message, each of its lines a mistake; every rank exits 2.

    Before any process group exists the ranks cannot wait for each other, and torchrun stops every
    worker as soon as the first one exits: a rank other than 0 that exited first could have rank 0
    killed before its line is out. So under torchrun those ranks linger (bounded, in case rank 0 is on
    a node whose agent never tells them) and let rank 0's exit end the job."""
    if rank == 0:
        print("\n".join(f"pretrain_gpt.py: error: {line}" for line in message.splitlines()), file=sys.stderr,
              flush=True)
    elif before_groups and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(_WAIT_FOR_RANK0_S)
    return 2


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` came out of a collective (a dead or stalled peer) rather than this rank's own work."""
    import torch.distributed as dist
    text = str(error)
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and any(
        marker in text for marker in _COLLECTIVE_MARKERS))


def restart_store(rank: int, world: int, timeout):
    """The rendezvous store of a torchrun worker, its keys prefixed by the restart attempt (else None).

    torchrun's agent keeps one store for the whole job; after a restart, the new workers would read the
    addresses the failed attempt's workers published there and fail to connect to dead peers.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not agent_hosts_it, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"ternion/attempt_{attempt}", base)


def _first_sentence(error: BaseException) -> str:
    """The error's first sentence, without gloo's source location; the rest is generic advice."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return re.split(r"(?<=\.)\s", first, maxsplit=1)[0]


class Guard:
    """One rank's hold on the job outside the trainer: the lock on --save, the heartbeat, where the run is.

    `where` is a text, or the trainer's Phase once it exists: what the failure line names.
    """

    def __init__(self, rank: int, timeout_minutes: float):
        self.rank, self.timeout_minutes = rank, timeout_minutes
        self.where = "building the process groups"
        self.liveness: Optional[Liveness] = None
        self.log_dir: Optional[str] = None  # where a failing rank writes its stack (stacks/rank<N>.txt)
        self._signal_stack: Optional[tuple] = None  # (open file, signal) of stacks_on_signal
        self._locks = []

    def take_lock(self, save_dir: Optional[str]) -> "Guard":
        """Rank 0 takes the lock on --save before any group exists (also the write test of --save): one writer per
        directory. Raises ConfigError with one line."""
        if self.rank == 0 and save_dir:
            self._locks.append(RunLock(save_dir).acquire())
        return self

    def watch_parent(self) -> None:
        """Under torchrun, a worker outlives no agent (see engine/run/preemption.py); the lock goes back first."""
        if "TORCHELASTIC_RUN_ID" in os.environ:
            from engine.run.preemption import watch_parent
            watch_parent(on_exit=self.release)

    def start_heartbeat(self, world: int) -> None:
        """Every rank's heartbeat and `where` in the job's store, so a failed collective can name who stopped."""
        from engine.parallel import comm
        store = comm.side_store("ternion/liveness") if world > 1 else None
        if store is not None:
            self.liveness = Liveness(store, self.rank, world, lambda: str(self.where)).start()

    def stacks_on_signal(self, signum) -> None:
        """On `signum` (SIGTERM: the launcher stopping the job), write this rank's stack to
        <log dir>/stacks/rank<N>.<SIGNAL>.txt at once, from C, even while the rank is blocked in a collective where no
        Python handler runs; then the handler installed before (pre-emption's flag) runs as usual. Call it after
        that handler is installed. A file left empty (no signal came) goes at release."""
        if not self.log_dir:
            return
        import faulthandler
        import signal
        path = os.path.join(self.log_dir, "stacks", f"rank{self.rank}.{signal.Signals(signum).name}.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._signal_stack = (open(path, "w"), signum)
        except OSError:
            return
        faulthandler.register(signum, file=self._signal_stack[0], all_threads=True, chain=True)

    def release(self) -> None:
        """Give back the lock on --save and stop the heartbeat (safe to call again)."""
        while self._locks:
            self._locks.pop().release()
        if self.liveness is not None:
            self.liveness.stop()
        if self._signal_stack is not None:
            import faulthandler
            fh, signum = self._signal_stack
            self._signal_stack = None
            faulthandler.unregister(signum)
            fh.close()
            if os.path.getsize(fh.name) == 0:
                os.remove(fh.name)

    def save_failed(self, error: BaseException) -> int:
        """A checkpoint save failed (on every rank alike: the ranks agreed on it): one line from rank 0, no traceback;
        exit 1. The previous checkpoint stays `latest`."""
        if self.rank == 0:
            print(f"pretrain_gpt.py: error: {error}; the previous checkpoint stays the latest; free space or fix "
                  "--save, then run the same command to resume", file=sys.stderr, flush=True)
        return 1

    def _last_collective(self) -> str:
        """The collective this rank issued last, with its group (the one that failed, not only the phase's)."""
        from engine.parallel import comm
        last = comm.last_collective()
        if last is None:
            return ""
        describe = getattr(self.where, "group_of", None)
        words = describe(*last) if describe is not None else f"{last[0]} over ranks {last[1]}"
        return f"; last collective: {words}"

    def _write_stack(self) -> str:
        """This rank's Python stack (every thread) in <log dir>/stacks/rank<N>.txt; the words saying where."""
        if not self.log_dir:
            return ""
        import faulthandler
        path = os.path.join(self.log_dir, "stacks", f"rank{self.rank}.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                faulthandler.dump_traceback(fh, all_threads=True)
        except OSError:
            return ""
        return f"; stack in {path}"

    def die(self, error: BaseException, where: Optional[str] = None) -> NoReturn:
        """One line naming the failed operation (`where`, else where the run is; the last collective and its
        group; from the heartbeats, the rank that stopped first) and where this rank's stack was written, then
        exit 1 at once: no teardown barrier a dead peer would block."""
        where, first = str(self.where) if where is None else where, _first_sentence(error)
        stack = self._write_stack()
        if is_collective_failure(error):
            culprits = self.liveness.culprits() if self.liveness is not None else None
            print(f"pretrain_gpt.py: rank {self.rank}: collective failed during {where}{self._last_collective()}: "
                  f"{first[:300]} ({culprits or 'a peer rank died or stalled'}; --distributed-timeout-minutes "
                  f"{self.timeout_minutes:g}){stack}; stopping", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
            print(f"pretrain_gpt.py: rank {self.rank}: {type(error).__name__} during {where}: {first[:300]}{stack}; "
                  "stopping", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.release()
        os._exit(1)

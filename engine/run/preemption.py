"""Stop cleanly when asked: SIGTERM / SIGUSR1 (pre-emption), SIGINT (Ctrl-C) or --exit-duration-in-mins.

A signal only sets a flag; the trainer finishes its step, asks `should_stop()` (one all-reduce, so
every rank agrees even when the signal reached only some of them), saves and exits 0. A signal during
a save lets the save finish first. Ctrl-C three times aborts at once without saving.

`watch_parent` ends a torchrun worker whose agent is gone (SIGKILLed, or stopped by a signal it does
not forward): the worker stops as if pre-empted — finishing its step and saving — and exits within a
grace period even if a peer never answers, so no orphan keeps training, writing or holding a GPU.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from engine.parallel.comm import any_rank

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
ABORT_AFTER_SIGINTS = 3


class PreemptionHandler:
    def __init__(self, exit_duration_in_mins: Optional[float] = None, signals=PREEMPTION_SIGNALS,
                 device="cpu", start_time: Optional[float] = None, exit_interval: Optional[int] = None):
        self.device = device
        self.deadline = None if exit_duration_in_mins is None else \
            (start_time or time.monotonic()) + 60.0 * exit_duration_in_mins
        self.received: Optional[str] = None
        self.interrupts = 0
        self.exit_interval = exit_interval
        self.reason: Optional[str] = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= ABORT_AFTER_SIGINTS:
                print("interrupted again: aborting without saving", file=sys.stderr, flush=True)
                os._exit(130)
        if self.received is None and os.environ.get("RANK", "0") == "0":
            print(f"received {name}: finishing this iteration, then saving and exiting"
                  + (f" (Ctrl-C {ABORT_AFTER_SIGINTS - 1} more times aborts without saving)"
                     if signum == signal.SIGINT else ""), file=sys.stderr, flush=True)
        self.received = name

    def should_stop(self, iteration: Optional[int] = None) -> bool:
        """Collective: True on every rank once any rank got a signal, the time limit has passed, or `iteration`
        is a multiple of --exit-interval (the same on every rank)."""
        return self.decide(any_rank(self.asked(), self.device), iteration)

    def asked(self) -> bool:
        """This rank's own reason to stop: a signal, or the time limit passed."""
        return self.received is not None or (self.deadline is not None and time.monotonic() >= self.deadline)

    def decide(self, any_asked: bool, iteration: Optional[int] = None) -> bool:
        """`should_stop` given whether any rank was `asked` (post-validation sums the flags in its own
        all-reduce, one iteration later, instead of this collective)."""
        interval = bool(self.exit_interval and iteration and iteration % self.exit_interval == 0)
        if (any_asked or interval) and self.reason is None:
            timed = self.deadline is not None and time.monotonic() >= self.deadline
            self.reason = f"signal {self.received}" if self.received else "--exit-duration-in-mins reached" \
                if timed else "another rank was asked to stop" if any_asked else f"--exit-interval {self.exit_interval}"
        return any_asked or interval

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def watch_parent(grace_s: float = 60.0, poll_s: float = 1.0, on_exit=None) -> threading.Thread:
    """Stop this process when its parent (the torchrun agent) dies: SIGTERM to itself (a clean stop with a
    save where the trainer is running), then, if it is still alive `grace_s` later (e.g. its teardown waits
    on the agent's store), call `on_exit` (giving back what the process holds) and exit 1."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"pid {os.getpid()}: the launching agent (pid {parent}) is gone; stopping this worker",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        if on_exit is not None:
            on_exit()
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread

"""Stop cleanly when the cluster asks: SIGTERM / SIGUSR1 (pre-emption) or --exit-duration-in-mins.

A signal only sets a flag; the trainer finishes its step, asks `should_stop()` (one all-reduce, so
every rank agrees even when the signal reached only some of them), saves and exits 0.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

from engine.parallel.comm import any_rank

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self, exit_duration_in_mins: Optional[float] = None, signals=PREEMPTION_SIGNALS,
                 device="cpu", start_time: Optional[float] = None):
        self.device = device
        self.deadline = None if exit_duration_in_mins is None else \
            (start_time or time.monotonic()) + 60.0 * exit_duration_in_mins
        self.received: Optional[str] = None
        self.reason: Optional[str] = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """Collective: True on every rank once any rank got a signal or the time limit has passed."""
        local = self.received is not None or (self.deadline is not None and time.monotonic() >= self.deadline)
        stop = any_rank(local, self.device)
        if stop and self.reason is None:
            self.reason = f"signal {self.received}" if self.received else \
                ("--exit-duration-in-mins reached" if local else "another rank was asked to stop")
        return stop

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

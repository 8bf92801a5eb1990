"""Which rank failed, and where it was: every rank's heartbeat and current phase, kept in the job's store.

When a collective fails, the error a surviving rank gets (gloo: a closed connection; NCCL: a timeout)
does not say which peer is gone, and torchrun's root-cause report names whichever worker exited first,
often a survivor. So every rank writes (time, phase) into the rendezvous store every `HEARTBEAT_S`
seconds from a daemon thread, over a connection of its own (`comm.side_store`: a store client is not
safe to share with the thread that rendezvouses through it), with its host. On a failure the rank that reports
it marks itself as a reporter (a survivor: its heartbeat may stop once it exits, which must not make it a
suspect), keeps its heartbeat going while it reports, reads them, waits two beats and reads again: a rank that
is no reporter and whose heartbeat stopped is dead (or its process frozen, e.g. SIGSTOP); they are named in the
order they stopped, the first one first. If every heartbeat moves, a rank whose phase differs from the
reporter's is alive but stuck elsewhere.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, Optional

HEARTBEAT_S = 2.0
_KEY = "ternion/liveness/{}"
_REPORTER = "ternion/liveness/reporter/{}"


class Liveness:
    def __init__(self, store, rank: int, world: int, phase: Callable[[], str], interval: float = HEARTBEAT_S):
        self.store, self.rank, self.world, self.phase, self.interval = store, rank, world, phase, interval
        self._stop = threading.Event()

    def start(self) -> "Liveness":
        self._beat()
        threading.Thread(target=self._loop, name="liveness-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - a slow store must not make a live rank look dead: beat again later
                continue

    def _beat(self) -> None:
        self.store.set(_KEY.format(self.rank), json.dumps({"t": time.time(), "phase": self.phase(),
                                                           "host": socket.gethostname()}))

    def read(self) -> dict:
        """rank -> {"t", "phase"} of every rank that has written one (never blocks on a missing key)."""
        out = {}
        for r in range(self.world):
            key = _KEY.format(r)
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def reporters(self) -> set:
        """The ranks that reported a failure themselves: survivors, whatever their heartbeat does afterwards."""
        return {r for r in range(self.world) if self.store.check([_REPORTER.format(r)])}

    def culprits(self) -> Optional[str]:
        """Words naming the ranks that stopped (first to stop first) or are elsewhere, or None when nothing can be
        told. The heartbeat goes on meanwhile: the other survivors, reporting too, must not suspect this rank."""
        try:
            self.store.set(_REPORTER.format(self.rank), str(time.time()))
            before = self.read()
            time.sleep(2.5 * self.interval)
            after, reporters = self.read(), self.reporters()
        except Exception:  # noqa: BLE001 - no store (its host died too): the caller says what it can
            return None
        others = [r for r in range(self.world) if r != self.rank and r not in reporters]
        stopped = [r for r in others if r not in after or after[r]["t"] == before.get(r, {}).get("t")]
        if stopped:
            stopped.sort(key=lambda r: after[r]["t"] if r in after else -1.0)
            words = [self._stopped(stopped[0], after.get(stopped[0]))]
            first = after.get(stopped[0], {}).get("t")
            for r in stopped[1:4]:
                later = f" {after[r]['t'] - first:.0f} s later" if r in after and first is not None else ""
                words.append(f"then rank {r}{later}")
            return "; ".join(words) + (f" (and {len(stopped) - 4} more)" if len(stopped) > 4 else "")
        mine = self.phase()
        elsewhere = [r for r in others if after[r]["phase"] != mine]
        if elsewhere:
            return "; ".join(f"rank {r} is alive but in {after[r]['phase']}" for r in elsewhere[:4])
        return None

    @staticmethod
    def _stopped(rank: int, info: Optional[dict]) -> str:
        if info is None:
            return f"rank {rank} never reported"
        host = f" on host {info['host']}" if info.get("host") else ""
        return f"rank {rank}{host} stopped answering {time.time() - info['t']:.0f} s ago (during {info['phase']})"

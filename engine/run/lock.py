"""One writer per `--save`: a lock file naming the job that owns the directory.

Two jobs saving into one directory corrupt each other (interleaved iterations, one job's clean-up
deleting the other's save in progress, a `latest` naming a file the other job replaced), so rank 0 takes
`<save>/.ternion.lock` before any process group exists and gives it back at exit. Creating the lock is
also the start-up write test of `--save`: a directory that cannot be created or written to fails in the
first second with one line, not at the first save. The lock records host, pid and start time, and its
holder touches it every `HEARTBEAT_S` seconds:

- held by a live process on this host, or touched within `STALE_AFTER_S` from another host: the second
  job is refused with one line naming the holder;
- held by a dead pid on this host, or silent for longer than `STALE_AFTER_S`: stale (the job was
  SIGKILLed); it is taken over, with a line saying so.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import threading
import time
from typing import Callable, Optional

from engine.config import ConfigError

LOCK_FILE = ".ternion.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, proc_start: Optional[str] = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        pass
    return proc_start is None or _proc_start(pid) in (None, proc_start)


@contextlib.contextmanager
def tool_output(out_dir: str, flag: str = "--out"):
    """The output directory of a tool (merge, conversion) while it writes: refused in one line when a running job
    holds it as its --save (its lock; held by the tool meanwhile), and a write that fails there (read-only, full)
    is one ConfigError line; a directory this made is removed again on failure (the writers stage and clean their
    own `.tmp`)."""
    made = not os.path.exists(out_dir)
    lock = RunLock(out_dir, log=lambda _line: None, flag=flag)
    try:
        lock.acquire()
    except ConfigError:
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    ok = False
    try:
        yield
        ok = True
    except OSError as e:
        raise ConfigError(f"{flag} {out_dir}: writing failed ({e.strerror or e}); free space or choose a writable "
                          "directory") from None
    finally:
        lock.release()
        if made and not ok:
            shutil.rmtree(out_dir, ignore_errors=True)


def _holder_line(info: dict) -> str:
    return f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}"


class RunLock:
    def __init__(self, save_dir: str, log: Callable = print, flag: str = "--save"):
        self.save_dir, self.log, self.flag = save_dir, log, flag
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                     "started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "proc_start": _proc_start(os.getpid())}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ take and give back
    def acquire(self) -> "RunLock":
        """Take the lock (creating --save), or raise ConfigError with one line."""
        try:
            os.makedirs(self.save_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{self.flag} {self.save_dir}: cannot create the directory ({e.strerror}); choose a "
                              "writable location") from None
        for _ in range(3):  # a stale lock removed by someone else between our read and create: try again
            if self._create():
                self._start_heartbeat()
                return self
            held = self._read()
            if held is None:
                continue
            stale = self._stale_reason(held)
            if stale is None:
                raise ConfigError(f"{self.flag} {self.save_dir} is in use by another job ({_holder_line(held)}): two "
                                  "jobs saving into one directory corrupt each other's checkpoints; give this job "
                                  f"its own --save, or stop the other one (if it is gone, delete {self.path})")
            self.log(f"{self.flag} {self.save_dir}: taking over the lock of a job that is gone ({_holder_line(held)}; "
                     f"{stale})")
            self._remove()
        raise ConfigError(f"{self.flag} {self.save_dir}: could not take {self.path}; another job keeps replacing it")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        held = self._read()
        if held is not None and held.get("pid") == self.info["pid"] and held.get("host") == self.info["host"]:
            self._remove()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ the file
    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise ConfigError(f"{self.flag} {self.save_dir}: not writable ({e.strerror}); choose a writable location "
                              "(checked at start so that no training is lost at the first save)") from None
        try:
            os.write(fd, json.dumps(self.info).encode())
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            self._remove()
            raise ConfigError(f"{self.flag} {self.save_dir}: writing failed ({e.strerror}); free space or choose "
                              "another location") from None
        os.close(fd)
        return True

    def _read(self) -> Optional[dict]:
        try:
            age = time.time() - os.path.getmtime(self.path)
            with open(self.path) as fh:
                text = fh.read()
        except FileNotFoundError:
            return None
        except OSError:
            text = ""
        try:
            info = json.loads(text)
        except ValueError:  # half-written by a job killed while creating it
            info = {"host": "?", "pid": None, "started": "?", "half_written": True}
        info["age_s"] = age
        return info

    def _remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def _stale_reason(self, held: dict) -> Optional[str]:
        """Why the holder is gone, or None while it may be alive."""
        if held.get("half_written"):
            return f"the lock file is half-written, last written {held['age_s']:.0f} s ago: its job died creating it"
        if held.get("host") == self.info["host"] and isinstance(held.get("pid"), int):
            pid = held["pid"]
            if _pid_alive(pid, held.get("proc_start")):
                return None
            return f"pid {pid} now belongs to another process" if _pid_alive(pid) else f"pid {pid} no longer runs"
        if held["age_s"] > STALE_AFTER_S:
            return f"not refreshed for {held['age_s']:.0f} s"
        return None

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    pass
        self._thread = threading.Thread(target=beat, name="save-lock-heartbeat", daemon=True)
        self._thread.start()

"""--profile: a torch.profiler trace of iterations --profile-step-start to --profile-step-end.

The trainer runs each iteration inside `profiler.step(iteration)`; the profiler starts before the
first profiled iteration (or the first one a resumed run reaches inside the window) and stops after
the last, writing one trace per rank into --tensorboard-dir. `close()` ends a window the run did not
reach the end of.
"""
from __future__ import annotations

import contextlib

import torch


class StepProfiler:
    def __init__(self, logging_cfg, rank: int, device, log=print):
        self.cfg, self.rank, self.device, self.log = logging_cfg, rank, torch.device(device), log
        self.profiler = None
        self.done = not logging_cfg.profile

    @contextlib.contextmanager
    def step(self, iteration: int):
        """Around iteration `iteration` (counted from 1)."""
        if not self.done and self.profiler is None and \
                self.cfg.profile_step_start <= iteration <= self.cfg.profile_step_end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        yield
        if iteration >= self.cfg.profile_step_end:
            self.close(iteration)

    def close(self, iteration: int) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        out = self.cfg.tensorboard_dir
        torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{self.rank}")(self.profiler)
        self.profiler, self.done = None, True
        self.log(f"profiler trace of iterations {self.cfg.profile_step_start}-{iteration} written to {out}")

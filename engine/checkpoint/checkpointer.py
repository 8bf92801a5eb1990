"""A run's checkpointing: where it saves, the asynchronous save in flight, and what it loads.

The trainer owns one `Checkpointer` (every rank does, and calls each method). At most one save is in
flight: the next save, a load, or `finalize()` waits for it first. While it is in flight it counts as
the latest checkpoint of its directory, so every rank gets the same answer to `latest()` whether or
not rank 0's writer has published it yet.
"""
from __future__ import annotations

import os
from typing import Optional

from engine.checkpoint.loader import latest_iteration, load_checkpoint
from engine.checkpoint.resume import ResumePoint, resume_point
from engine.checkpoint.saver import PendingSave, save_checkpoint


class Checkpointer:
    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.pending: Optional[PendingSave] = None

    def save(self, iteration: int, model_chunks: list, optimizer, extra_state: dict) -> None:
        """Save iteration `iteration` into --save (in the background with --async-save)."""
        self.finalize()
        self.pending = save_checkpoint(self.cfg.checkpoint.save, iteration, model_chunks, optimizer, self.ctx, self.cfg,
                                       extra_state, async_save=self.cfg.checkpoint.async_save)

    def check_in_flight(self) -> None:
        """Collective, once per iteration: a background save that failed on any rank stops the run now, on
        every rank, naming the rank and its error (not at the next save, iterations later)."""
        if self.pending is not None and self.pending.failed():
            self.finalize()

    def finalize(self) -> None:
        """Wait for the save in flight, if any; raise on every rank if it failed (call before exiting too)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finish()
            if pending.report is not None:  # the "saved ... (async)" line, said before what follows
                pending.report.join()

    def latest(self, directory: str) -> Optional[int]:
        """The newest complete iteration in `directory`, counting the save in flight there."""
        pending = self.pending
        if pending is not None and os.path.abspath(pending.save_dir) == os.path.abspath(directory):
            return pending.iteration
        return latest_iteration(directory)

    def resume_point(self, log=None) -> Optional[ResumePoint]:
        """Where this run resumes from (collective; see resume.py); None: from scratch (after logging why
        when the choice needs saying)."""
        point = resume_point(self.cfg.checkpoint, self.latest, self.ctx.rank)
        if point is not None and point.note:
            if log is not None:
                log(point.note)
            return None
        for line in point.told if point is not None and log is not None else ():
            log(line)
        return point

    def load(self, directory: str, model_chunks: list, optimizer, load_optim: bool = True,
             iteration: Optional[int] = None) -> Optional[dict]:
        """Load `iteration` (default the newest complete checkpoint) of `directory` (see loader.load_checkpoint);
        None if there is none."""
        self.finalize()
        return load_checkpoint(directory, model_chunks, optimizer, self.ctx, fallback=self.cfg.checkpoint.ckpt_fallback,
                               load_optim=load_optim, iteration=iteration, model_cfg=self.cfg.model)

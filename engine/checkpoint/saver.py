"""Write a checkpoint: every rank its shard files, rank 0 the metadata and the rename that publishes it.

Order of events, chosen so that a crash at any instant (SIGKILL included) leaves the previous
checkpoint complete and `latest_checkpointed_iteration.txt` naming a complete one:
1. rank 0 clears leftovers of interrupted saves and creates `iter_N.tmp/`; one all-gather then
   shares every rank's tensor descriptions (and waits for the folder);
2. each writing rank writes and fsyncs its files, then a small `.done` marker with their checksums;
3. rank 0 waits for every marker, writes metadata.json (fsync), renames `iter_N.tmp` to `iter_N`,
   fsyncs the parent, rewrites `latest` atomically, and applies retention.
Under `async_save` the state is first copied off the training tensors (the only stall); steps 2-3
then run in a thread that does file I/O only, never a collective, so training keeps its group to
itself, and `save_checkpoint` returns the save in flight: its `finish()` (collective) waits for it.
The run's `Checkpointer` holds it and keeps at most one in flight.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Optional

import torch

from engine import fp8
from engine.checkpoint import files, rng
from engine.checkpoint.layout import local_tensors, model_shard, optim_shard, shard_file
from engine.checkpoint.metadata import OPTIMIZER_KEYS, CheckpointMeta, FileRecord, OptimizerMeta, RankPart
from engine.parallel.comm import all_gather_object, any_rank

_MARKER = ".done.rank{:05d}.json"
_CANCELLED = "stopped waiting for the other ranks' files"


def save_checkpoint(save_dir: str, iteration: int, model_chunks: list, optimizer, ctx, cfg, extra_state: dict,
                    async_save: bool = False) -> Optional["PendingSave"]:
    """Save this rank's part of iteration `iteration`; every rank calls it. See the module docstring.

    Returns None once the checkpoint is published, or with `async_save` the save in flight."""
    tmp = os.path.join(save_dir, files.iter_dir_name(iteration) + ".tmp")
    if ctx.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        files.remove_stale(save_dir)
        os.makedirs(tmp)
    # ZeRO-3 weights are whole only inside full_weights(): copied out there, since they are freed after.
    sharded = getattr(optimizer, "sharder", None) is not None
    with optimizer.full_weights() if optimizer is not None else contextlib.nullcontext():
        shards, part = _snapshot(model_chunks, optimizer, ctx, copy=async_save or sharded)
    part.rng, part.fp8 = rng.capture(ctx.rng), fp8.state_dict(model_chunks)
    everyone = all_gather_object(part)
    meta = CheckpointMeta.build(everyone, iteration, ctx, cfg.to_dict(), extra_state) if ctx.rank == 0 else None
    writers = sorted(p.rank for p in everyone if p.files)
    timeout = 60.0 * max(cfg.parallel.distributed_timeout_minutes, 1.0)
    job = PendingSave(save_dir, tmp, iteration, shards, ctx.rank, meta, writers, cfg.checkpoint, timeout)
    if async_save:
        job.thread = threading.Thread(target=job.run, name=f"checkpoint-save-{iteration}", daemon=True)
        job.thread.start()
        return job
    job.guarded(job.write_shards)
    job.agree()  # every rank wrote its files, or every rank raises naming the first that failed (disk full...)
    if ctx.rank == 0:
        job.guarded(job.publish)
    job.agree()  # every rank returns once the checkpoint is published, or every rank raises
    return None


def _copy(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()
    if t.is_cuda:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.clone() if copy else t


def _snapshot(model_chunks: list, optimizer, ctx, copy: bool) -> tuple:
    """({file: [(key, tensor)]} this rank writes, the RankPart rank 0 builds the metadata from)."""
    t, d, p = ctx.tp_rank, ctx.dp_cp_rank, ctx.pp_rank  # d: the optimizer shard (dp x cp replica)
    # Model files hold experts too: an EP rank's experts are written by its own dp x cp replica.
    model_file = shard_file("model", t, p, d if ctx.ep_size > 1 else None)
    shards, part = {}, RankPart(ctx.rank)
    tensors = local_tensors(model_chunks, ctx)
    for lt in tensors:
        if lt.writer:
            shards.setdefault(model_file, []).append((lt.name, _copy(lt.param, copy)))
            part.model[lt.name] = model_shard(lt, lt.param.dtype, lt.split(ctx)[1], p, model_file)
    if optimizer is not None:
        state = optimizer.state_dict()
        distributed = bool(state["distributed"])
        optim_file = shard_file("optim", t, p, d if distributed or ctx.ep_size > 1 else None)
        by_local = {lt.local_name: lt for lt in tensors}
        for local_name, entry in state["params"].items():
            lt = by_local[local_name]
            shared_copy = lt.name != lt.local_name
            if shared_copy or (lt.tp_axis is None and t != 0) or (not distributed and lt.replica_rank(ctx) != 0):
                continue
            keys = [k for k in OPTIMIZER_KEYS if k in entry]
            for k in keys:
                shards.setdefault(optim_file, []).append((f"{lt.name}/{k}", _copy(entry[k].reshape(-1), copy)))
            part.optim[lt.name] = optim_shard(lt, keys, lt.split(ctx)[1], optim_file, entry["range"])
        part.optimizer = OptimizerMeta(distributed, int(state["step"]), state["scaler"], state.get("optimizer", "adam"))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the pinned device-to-host copies above are asynchronous
    part.files = sorted(shards)
    return shards, part


class SaveFailed(RuntimeError):
    """A save that failed on some rank (a full or read-only disk): raised on every rank alike, so the launcher says
    it once (rank 0) instead of a traceback per rank."""


class PendingSave:
    """The I/O half of one save; runs inline or in a thread, and touches no process group (but `finish`)."""

    def __init__(self, save_dir, tmp, iteration, shards, rank, meta, writers, ckpt_cfg, timeout):
        self.save_dir, self.tmp, self.iteration = save_dir, tmp, iteration
        self.shards, self.rank, self.meta, self.writers = shards, rank, meta, writers
        self.ckpt_cfg, self.timeout = ckpt_cfg, timeout
        self.error: Optional[str] = None
        self.thread: Optional[threading.Thread] = None
        self.report: Optional[threading.Thread] = None  # rank 0's "saved ... (async)" line (engine.metrics.save_report)
        self.cancelled = threading.Event()

    def finish(self) -> None:
        """Wait for the writer thread; raise on every rank if any rank failed. Every rank calls it.

        It ends with a collective: only rank 0 publishes, so no rank may look for the checkpoint earlier.
        """
        if self.thread is not None:
            self.thread.join()
        self.agree()

    def failed(self) -> bool:
        """Collective, for a save in flight: has any rank's writer failed yet? Then every rank stops it and
        `finish()` raises the failure; training need not wait for the next save to hear of it."""
        if not any_rank(self.error is not None):
            return False
        self.cancelled.set()  # rank 0 stops waiting for markers that will never come
        return True

    def agree(self) -> None:
        """Collective: raise on every rank, naming the first rank that failed and its error."""
        errors = all_gather_object(self.error)
        failed = [(r, e) for r, e in enumerate(errors) if e and _CANCELLED not in e]
        failed = failed or [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            rank, error = failed[0]
            raise SaveFailed(f"saving checkpoint iteration {self.iteration} to {self.save_dir} failed on rank "
                             f"{rank}: {error}")

    def guarded(self, step) -> None:
        """Run one step of the save; an error is kept for agree() (a crashed writer must not kill training
        silently), and a non-zero rank also leaves it where rank 0's marker wait sees it."""
        if self.error is not None:
            return
        try:
            step()
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            if self.rank != 0:
                try:
                    files.write_json_atomic(os.path.join(self.tmp, _MARKER.format(self.rank)), {"error": self.error})
                except OSError:  # a full disk takes the marker too: agree()/failed() still carry the error
                    pass

    def run(self) -> None:
        self.guarded(self.write_shards)
        if self.rank == 0:
            self.guarded(self.publish)

    def write_shards(self) -> None:
        if not self.shards:
            return
        done = {}
        for name, items in self.shards.items():
            path = os.path.join(self.tmp, name)
            specs = [(key, t.dtype, tuple(t.shape)) for key, t in items]
            sha = files.write_safetensors(path, specs, items)
            done[name] = {"bytes": os.path.getsize(path), "sha256": sha}
        self.shards = None  # drop the copies as soon as they are on disk
        files.write_json_atomic(os.path.join(self.tmp, _MARKER.format(self.rank)), done)

    def publish(self) -> None:
        self.meta.files = self._collect_markers()
        publish(self.save_dir, self.tmp, self.iteration, self.meta, self.ckpt_cfg.keep_last, self.ckpt_cfg.keep_every)

    def _collect_markers(self) -> dict:
        deadline = time.monotonic() + self.timeout
        checksums, waiting = {}, set(self.writers)
        while waiting:
            for r in sorted(waiting):
                path = os.path.join(self.tmp, _MARKER.format(r))
                if os.path.isfile(path):
                    with open(path) as fh:
                        got = json.load(fh)
                    if "error" in got:
                        raise RuntimeError(f"rank {r}: {got['error']}")
                    checksums.update({name: FileRecord(**rec) for name, rec in got.items()})
                    os.remove(path)
                    waiting.discard(r)
            if waiting:
                if self.cancelled.is_set():
                    raise RuntimeError(f"{_CANCELLED} (another rank failed)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(waiting)} did not finish writing within {self.timeout:.0f}s")
                time.sleep(0.005)
        return checksums


def publish(save_dir: str, tmp: str, iteration: int, meta: CheckpointMeta, keep_last=None, keep_every=None) -> None:
    """Write metadata.json into the finished `tmp` folder, rename it into place, point `latest` at it."""
    files.write_json_durable(os.path.join(tmp, files.METADATA_FILE), meta.to_json())
    files.fsync_dir(tmp)
    final = os.path.join(save_dir, files.iter_dir_name(iteration))
    if os.path.exists(final):
        _move_aside(save_dir, iteration)
    os.rename(tmp, final)
    files.fsync_dir(save_dir)
    files.write_text_atomic(os.path.join(save_dir, files.LATEST_FILE), f"{iteration}\n")
    if keep_last:
        _retain(save_dir, iteration, keep_last, keep_every)


def _move_aside(save_dir: str, iteration: int) -> None:
    """Re-saving an iteration: first point `latest` at another complete one, so no instant names a gap."""
    others = [i for i in files.list_iterations(save_dir) if i != iteration]
    latest = os.path.join(save_dir, files.LATEST_FILE)
    if others:
        files.write_text_atomic(latest, f"{others[-1]}\n")
    elif os.path.exists(latest):
        os.remove(latest)
    files.remove_tree(os.path.join(save_dir, files.iter_dir_name(iteration)))


def _retain(save_dir: str, iteration: int, keep_last: int, keep_every) -> None:
    """Keep the newest `keep_last`, every multiple of `keep_every`, and the one just saved."""
    done = files.list_iterations(save_dir)
    keep = set(done[-keep_last:]) | {iteration}
    if keep_every:
        keep |= {i for i in done if i % keep_every == 0}
    for i in done:
        if i not in keep:
            files.remove_tree(os.path.join(save_dir, files.iter_dir_name(i)))

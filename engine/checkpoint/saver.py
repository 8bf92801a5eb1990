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

import json
import os
import threading
import time
from typing import Optional

import torch

from engine.checkpoint import files, rng
from engine.checkpoint.layout import local_tensors
from engine.checkpoint.reader import FORMAT
from engine.parallel.comm import all_gather_object, any_rank

_MARKER = ".done.rank{:05d}.json"


def save_checkpoint(save_dir: str, iteration: int, model_chunks: list, optimizer, ctx, cfg, extra_state: dict,
                    async_save: bool = False) -> Optional["PendingSave"]:
    """Save this rank's part of iteration `iteration`; every rank calls it. See the module docstring.

    Returns None once the checkpoint is published, or with `async_save` the save in flight."""
    tmp = os.path.join(save_dir, files.iter_dir_name(iteration) + ".tmp")
    if ctx.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        files.remove_stale(save_dir)
        os.makedirs(tmp)
    shards, descriptor = _snapshot(model_chunks, optimizer, ctx, copy=async_save)
    descriptor["rng"] = rng.capture(ctx.rng)
    everyone = all_gather_object(descriptor)
    meta = build_metadata(everyone, iteration, ctx, cfg.to_dict(), extra_state) if ctx.rank == 0 else None
    writers = sorted(d["rank"] for d in everyone if d["files"])
    timeout = 60.0 * max(cfg.parallel.distributed_timeout_minutes, 1.0)
    job = PendingSave(save_dir, tmp, iteration, shards, ctx.rank, meta, writers, cfg.checkpoint, timeout)
    if async_save:
        job.thread = threading.Thread(target=job.run, name=f"checkpoint-save-{iteration}", daemon=True)
        job.thread.start()
        return job
    job.run()
    job.agree()  # every rank returns once the checkpoint is published, or every rank raises
    return None


def _copy(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()
    if t.is_cuda:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.clone() if copy else t


def _snapshot(model_chunks: list, optimizer, ctx, copy: bool) -> tuple:
    """{file: [(key, tensor)]} this rank writes, and the descriptor rank 0 builds metadata from."""
    t, d, p = ctx.tp_rank, ctx.dp_rank, ctx.pp_rank
    model_file = f"model_tp{t:02d}_pp{p:02d}.safetensors"
    shards: dict = {}
    desc = {"rank": ctx.rank, "model": {}, "optim": {}, "files": []}
    tensors = local_tensors(model_chunks, ctx)
    for lt in tensors:
        if not lt.writer:
            continue
        shards.setdefault(model_file, []).append((lt.name, _copy(lt.param, copy)))
        desc["model"][lt.name] = dict(shape=list(lt.full_shape), dtype=str(lt.param.dtype).removeprefix("torch."),
                                      tp_axis=lt.tp_axis, valid_rows=lt.valid_rows, tp_rank=t, file=model_file,
                                      pp_rank=p, vpp_chunk=lt.chunk)
    if optimizer is not None:
        state = optimizer.state_dict()
        distributed = bool(state["distributed"])
        optim_file = f"optim_tp{t:02d}_pp{p:02d}" + (f"_dp{d:03d}" if distributed else "") + ".safetensors"
        by_local = {lt.local_name: lt for lt in tensors}
        for local_name, entry in state["params"].items():
            lt = by_local[local_name]
            shared_copy = lt.name != lt.local_name
            if shared_copy or (lt.tp_axis is None and t != 0) or (not distributed and d != 0):
                continue
            keys = [k for k in ("exp_avg", "exp_avg_sq", "master") if k in entry]
            for k in keys:
                shards.setdefault(optim_file, []).append((f"{lt.name}/{k}", _copy(entry[k].reshape(-1), copy)))
            desc["optim"][lt.name] = dict(shape=list(lt.full_shape), tp_axis=lt.tp_axis, valid_rows=lt.valid_rows,
                                          keys=keys, tp_rank=t, file=optim_file, range=list(entry["range"]))
        desc["optimizer"] = {"distributed": distributed, "step": int(state["step"]), "scaler": state["scaler"]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the pinned device-to-host copies above are asynchronous
    desc["files"] = sorted(shards)
    return shards, desc


def build_metadata(everyone: list, iteration: int, ctx, config: dict, extra_state: dict) -> dict:
    """metadata.json (file checksums still empty) from every rank's descriptor."""
    tensors, optim = {}, {}
    for desc in everyone:
        for name, spec in desc["model"].items():
            entry = tensors.setdefault(name, {k: v for k, v in spec.items() if k not in ("tp_rank", "file")})
            parts = 1 if spec["tp_axis"] is None else ctx.tp_size
            entry.setdefault("shards", [None] * parts)[spec["tp_rank"]] = spec["file"]
        for name, spec in desc["optim"].items():
            entry = optim.setdefault(name, {k: spec[k] for k in ("shape", "tp_axis", "valid_rows", "keys")})
            parts = 1 if spec["tp_axis"] is None else ctx.tp_size
            entry.setdefault("shards", [[] for _ in range(parts)])[spec["tp_rank"]].append(
                {"file": spec["file"], "range": spec["range"]})
    for entry in optim.values():
        for shard in entry["shards"]:
            shard.sort(key=lambda piece: piece["range"][0])
    stages = [[] for _ in range(ctx.pp_size)]
    for name, entry in sorted(tensors.items()):
        if name.startswith("layers."):
            chunk = stages[entry["pp_rank"]]
            chunk.extend([] for _ in range(entry["vpp_chunk"] + 1 - len(chunk)))
            layer = int(name.split(".")[1])
            if layer not in chunk[entry["vpp_chunk"]]:
                chunk[entry["vpp_chunk"]].append(layer)
    extra = json.loads(json.dumps(extra_state or {}))  # a JSON round trip: fail now, not in the writer thread
    opt_desc = next((d["optimizer"] for d in everyone if "optimizer" in d), None)
    return {
        "format": FORMAT, "version": 1, "iteration": iteration,
        "consumed_samples": extra.get("consumed_samples"),
        "layout": {"tp": ctx.tp_size, "pp": ctx.pp_size, "vpp": ctx.vpp_size, "dp": ctx.dp_size,
                   "world_size": ctx.world_size, "distributed_optimizer": bool(opt_desc and opt_desc["distributed"]),
                   "stage_layers": [[sorted(c) for c in s] for s in stages]},
        "config": config,
        "vocab_size": next((e["valid_rows"] for e in tensors.values() if e.get("valid_rows")), None),
        "extra_state": extra,
        "optimizer": opt_desc,
        "tensors": tensors,
        "optimizer_tensors": optim,
        "rng": [d["rng"] for d in sorted(everyone, key=lambda d: d["rank"])],
        "files": {},
        "saved_at": time.time(),
    }


class PendingSave:
    """The I/O half of one save; runs inline or in a thread, and touches no process group (but `finish`)."""

    def __init__(self, save_dir, tmp, iteration, shards, rank, meta, writers, ckpt_cfg, timeout):
        self.save_dir, self.tmp, self.iteration = save_dir, tmp, iteration
        self.shards, self.rank, self.meta, self.writers = shards, rank, meta, writers
        self.ckpt_cfg, self.timeout = ckpt_cfg, timeout
        self.error: Optional[str] = None
        self.thread: Optional[threading.Thread] = None

    def finish(self) -> None:
        """Wait for the writer thread; raise on every rank if any rank failed. Every rank calls it.

        It ends with a collective: only rank 0 publishes, so no rank may look for the checkpoint earlier.
        """
        if self.thread is not None:
            self.thread.join()
        self.agree()

    def agree(self) -> None:
        if any_rank(self.error is not None):
            self.error = self.error or "another rank failed to write its part"
            raise RuntimeError(f"saving checkpoint iteration {self.iteration} to {self.save_dir} failed: {self.error}")

    def run(self) -> None:
        try:
            self._write_shards()
            if self.rank == 0:
                self._publish()
        except Exception as e:  # reported by agree(); a crashed writer must not kill training silently
            self.error = f"{type(e).__name__}: {e}"
            if self.rank != 0:  # tell rank 0 now rather than let it wait for the timeout
                try:
                    files.write_json_atomic(os.path.join(self.tmp, _MARKER.format(self.rank)), {"error": self.error})
                except OSError:
                    pass

    def _write_shards(self) -> None:
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

    def _publish(self) -> None:
        self.meta["files"] = self._collect_markers()
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
                    checksums.update(got)
                    os.remove(path)
                    waiting.discard(r)
            if waiting:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(waiting)} did not finish writing within {self.timeout:.0f}s")
                time.sleep(0.005)
        return checksums


def publish(save_dir: str, tmp: str, iteration: int, meta: dict, keep_last=None, keep_every=None) -> None:
    """Write metadata.json into the finished `tmp` folder, rename it into place, point `latest` at it."""
    files.write_json_durable(os.path.join(tmp, files.METADATA_FILE), meta)
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

"""Sharded, self-describing, atomically published checkpoints that load under any layout.

On disk (the layout the project's interface contract fixes):
    <save>/latest_checkpointed_iteration.txt          the newest complete iteration, written last
    <save>/iter_0000100/metadata.json                 layout, config, iteration, consumed samples, extra
                                                      state (scheduler, sampler, ...), loss scaler and
                                                      optimizer step, every tensor's global shape and
                                                      split (tp axis and shard files, pp rank, vpp chunk,
                                                      dp ranges of optimizer state), RNG states per rank,
                                                      size and sha256 of every file
    <save>/iter_0000100/model_tpTT_ppPP.safetensors   the model slice of one (tp, pp) rank
    <save>/iter_0000100/optim_tpTT_ppPP[_dpDDD].safetensors   fp32 Adam moments (+ master weights),
                                                      flat per parameter, per dp rank under the
                                                      distributed optimizer
Replicated tensors are stored once (tp rank 0), the tied embedding once (first stage). Each save is
written to iter_N.tmp/, fsync'd, renamed, and only then named by `latest` (see saver.py).

A run saves and loads through a `Checkpointer` (checkpointer.py), which keeps the asynchronous save in
flight; `save_checkpoint` / `load_checkpoint` are the single operations beneath it (every rank calls
each one). metadata.json is typed in metadata.py. `extra_state` must be JSON-serializable. Damaged or
missing checkpoints raise engine.config.ConfigError with one line naming the file. Tools:
`CheckpointReader` reads any slice of a saved tensor; `load_merged` loads tools/merge_ckpt.py's native
output into model chunks. Other formats come in and go out through subpackages that write and read this one:
`hf/` (transformers folders) and `megatron/` (Megatron-LM's torch_dist and legacy checkpoints).
"""
from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.loader import latest_iteration, load_checkpoint
from engine.checkpoint.merged import load_merged
from engine.checkpoint.reader import CheckpointReader
from engine.checkpoint.saver import save_checkpoint

__all__ = ["Checkpointer", "save_checkpoint", "load_checkpoint", "latest_iteration", "CheckpointReader",
           "load_merged"]

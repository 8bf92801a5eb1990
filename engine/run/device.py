"""Which device and torch.distributed backend a rank runs on, settled before any process group exists.

Megatron-LM's `--distributed-backend {nccl,gloo}` names the backend; left out, it follows the device, as
Megatron-LM's nccl does on GPUs: nccl on CUDA, gloo on the CPU (`--device auto`: CUDA when a GPU is
visible). NCCL needs a GPU of its own per rank (it refuses two ranks on one device), so under nccl the
ranks of a node take the visible GPUs one each. gloo runs on CUDA tensors too (engine/parallel/comm.py says
which collectives it carries and stages the rest through host memory), so under gloo the ranks of a node
share the visible GPUs, LOCAL_RANK modulo their count: that is how one GPU hosts 2-4 ranks and runs the
multi-rank layouts. The functions take what torch reports as arguments, so they are tested without a GPU.
"""
from __future__ import annotations

from typing import Optional

from engine.config import ConfigError

BACKEND_FLAG = "--distributed-backend"


def device_and_backend(device: str, backend: Optional[str], cuda_available: bool) -> tuple:
    """(device type, backend) for `--device` and `--distributed-backend`; a mistake is one ConfigError line."""
    if device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    on_cuda = device == "cuda" or (device == "auto" and cuda_available)
    backend = backend or ("nccl" if on_cuda else "gloo")
    if backend == "nccl" and not on_cuda:
        where = "--device cpu" if device == "cpu" else "no CUDA device is visible"
        raise ConfigError(f"{BACKEND_FLAG} nccl: NCCL runs on CUDA devices only and this run is on the CPU "
                          f"({where}); use {BACKEND_FLAG} gloo, or leave the flag out")
    return ("cuda" if on_cuda else "cpu"), backend


def gpu_index(backend: str, local_rank: int, local_world: int, gpus: int) -> int:
    """The visible GPU a rank computes on: one per rank under nccl, shared (LOCAL_RANK modulo their count) under
    gloo."""
    if backend == "gloo":
        return local_rank % gpus
    if local_world > gpus:
        raise ConfigError(f"{BACKEND_FLAG} nccl: {local_world} ranks on this node but {gpus} visible GPU(s), and "
                          f"NCCL needs a GPU per rank; start at most {gpus} rank(s) per node, or use "
                          f"{BACKEND_FLAG} gloo to share the GPUs")
    return local_rank

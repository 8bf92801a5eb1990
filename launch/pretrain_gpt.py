"""Pretrain a GPT/Llama model: `torchrun [torchrun flags] launch/pretrain_gpt.py [--config F.yaml] [flags]`.

Order of work: parse and validate every flag (a user mistake ends here with one line and exit 2,
before any process group exists), pick the device and backend, build the process groups, then hand
over to engine.training.Trainer (build, start = resume from the latest checkpoint, banner, train).
Teardown is ordered (barrier, destroy) so gloo exits cleanly. Under torchrun every restart attempt
rendezvouses under its own key prefix (see `_restart_store`), so `--max-restarts N` resumes on its own.

Failures once the groups exist: a collective that fails (a peer died, or stalled past
--distributed-timeout-minutes, after which gloo raises inside the collective) ends this rank with one
line naming the operation and its group and exit code 1, at once and without the teardown barrier, so
no rank waits on a dead peer and torchrun (--max-restarts) can restart the job, which then resumes from
the latest checkpoint. Any other exception is printed with its traceback and ends the rank the same way.
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import time
import traceback
import warnings

from engine.cli import parse_config
from engine.config import ConfigError
from engine.resolve import resolve
from engine.validation import validate

_WAIT_FOR_RANK0_S = 30.0
_held = []  # rank 0's lock on --save, given back however the process ends (os._exit included)


def _release_locks() -> None:
    while _held:
        _held.pop().release()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _fail(message: str, rank: int, before_groups: bool = False) -> int:
    """Rank 0 prints the one line; every rank exits 2.

    Before any process group exists the ranks cannot wait for each other, and torchrun stops every
    worker as soon as the first one exits: a rank other than 0 that exited first could have rank 0
    killed before its line is out. So under torchrun those ranks linger (bounded, in case rank 0 is on
    a node whose agent never tells them) and let rank 0's exit end the job."""
    if rank == 0:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    elif before_groups and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(_WAIT_FOR_RANK0_S)
    return 2


def _is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist
    text = str(error)
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and any(
        marker in text for marker in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out",
                                      "timed out", "Broken pipe")))


def _die(error: BaseException, rank: int, where: str, timeout_minutes: float, liveness=None) -> None:
    """One line naming the failed operation (and, from the heartbeats, the rank that stopped), then exit 1 at
    once: no teardown barrier a dead peer would block."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)  # gloo's source location
    first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]  # its first sentence; the rest is generic advice
    if _is_collective_failure(error):
        culprits = liveness.culprits() if liveness is not None else None
        print(f"pretrain_gpt.py: rank {rank}: collective failed during {where}: {first[:300]} "
              f"({culprits or 'a peer rank died or stalled'}; --distributed-timeout-minutes {timeout_minutes:g}); "
              "stopping", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
        print(f"pretrain_gpt.py: rank {rank}: {type(error).__name__} during {where}: {first[:300]}; stopping",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    _release_locks()
    os._exit(1)


def _restart_store(rank: int, world: int, timeout):
    """The rendezvous store of a torchrun worker, its keys prefixed by the restart attempt (else None).

    torchrun's agent keeps one store for the whole job; after a restart, the new workers would read the
    addresses the failed attempt's workers published there and fail to connect to dead peers.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not agent_hosts_it, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"ternion/attempt_{attempt}", base)


def _pick_device(cfg, world: int) -> tuple:
    """(device, backend): cuda + nccl when asked for or visible, else cpu + gloo with OMP_NUM_THREADS threads
    where the user set it, this process's share of the cores otherwise."""
    import torch
    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    if cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        return f"cuda:{torch.cuda.current_device()}", "nccl"
    if not os.environ.get("OMP_NUM_THREADS"):  # the user's setting wins; torch has already applied it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(_env_int("LOCAL_WORLD_SIZE", world), 1)))
    return "cpu", "gloo"


def _configure(argv, rank: int, world: int) -> tuple:
    """Flags -> (resolved config, device, backend), and rank 0's lock on --save; a mistake is a ConfigError
    raised before any process group exists."""
    cfg = parse_config(argv)
    if cfg.parallel.gpus_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
        cfg.parallel.gpus_per_node = _env_int("LOCAL_WORLD_SIZE", world)
    validate(cfg, world)
    resolve(cfg, world)
    device, backend = _pick_device(cfg, world)
    if rank == 0 and cfg.checkpoint.save:  # one writer per --save, before any group: also the write test of --save
        from engine.checkpoint.lock import RunLock
        _held.append(RunLock(cfg.checkpoint.save).acquire())
    for note in cfg.notices if rank == 0 else ():  # choices made for the user (e.g. --data-path over mock data)
        print(f"pretrain_gpt.py: note: {note}", flush=True)
    return cfg, device, backend


def _init_process_group(cfg, backend: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if "MASTER_ADDR" not in os.environ:  # plain `python launch/pretrain_gpt.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                            store=_restart_store(rank, world, timeout))


def _teardown(ctx, liveness, rank: int, timeout_minutes: float) -> None:
    """Every rank waits for the others, then the groups go; a peer that died meanwhile ends this rank at once.

    The lock on --save goes first: every write of this rank is done, and a process group torn down after its
    torchrun agent died can abort the process in C++ (gloo), past any Python cleanup."""
    import torch.distributed as dist

    from engine.parallel import comm
    _release_locks()
    if liveness is not None:
        liveness.stop()
    if dist.is_initialized():
        try:
            comm.barrier()
            if ctx is not None:
                ctx.destroy()
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a peer that died after this rank finished
            _die(e, rank, "the teardown barrier (all ranks)", timeout_minutes, liveness)
    _release_locks()


def main(argv=None) -> int:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        cfg, device, backend = _configure(argv, rank, world)
    except ConfigError as e:
        return _fail(str(e), rank, before_groups=True)

    import torch

    from engine.preemption import watch_parent
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker outlives no agent (see engine/preemption.py)
        watch_parent(on_exit=_release_locks)

    from engine.liveness import Liveness
    from engine.parallel import comm
    from engine.parallel.topology import build_context, layout_table
    from engine.report import banner, report_arguments
    from engine.training import Trainer

    _init_process_group(cfg, backend, rank, world)
    ctx = trainer = liveness = None
    where = "building the process groups"
    store = comm.side_store("ternion/liveness") if world > 1 else None
    if store is not None:  # who stopped, and where, when a collective fails
        liveness = Liveness(store, rank, world, lambda: str(trainer.phase) if trainer else where).start()
    par = cfg.parallel
    try:
        ctx = build_context(world, rank, cfg.tp, cfg.pp, vpp=cfg.vpp, sequence_parallel=par.sequence_parallel,
                            gpus_per_node=par.gpus_per_node, timeout_minutes=par.distributed_timeout_minutes,
                            seed=cfg.training.seed, device_type=torch.device(device).type, cp=cfg.cp,
                            cp_comm_type=par.cp_comm_type, ep=par.expert_model_parallel_size)
        where = "building the model, optimizer and data"
        log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
        report_arguments(cfg, rank, log)  # rank 0: the resolved arguments, printed and saved beside the metrics
        with warnings.catch_warnings():
            if rank != 0:
                warnings.simplefilter("ignore")
            trainer = Trainer(cfg, ctx, device, log=log)
            trainer.start()
            with trainer.phase("the start-up banner (all_gather_object)", "all"):
                table = layout_table(world, cfg.tp, cfg.pp, par.gpus_per_node, cfg.cp)
                log(banner(cfg, ctx, trainer.chunks, device, table))
            trainer.train()
    except ConfigError as e:
        return _fail(str(e), rank)
    except Exception as e:  # noqa: BLE001 - every failure must end this rank now, never hang in teardown
        _die(e, rank, str(trainer.phase) if trainer is not None else where, par.distributed_timeout_minutes, liveness)
    finally:
        _teardown(ctx, liveness, rank, par.distributed_timeout_minutes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

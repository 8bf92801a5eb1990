"""Pretrain a GPT/Llama model: `torchrun [torchrun flags] launch/pretrain_gpt.py [--config F.yaml] [flags]`.

Order of work: parse and validate every flag (user mistakes end here, one line each, exit 2,
before any process group exists), pick the device and backend, build the process groups, then hand
over to engine.training.Trainer (build, start = resume from the latest checkpoint, banner, train).
Teardown is ordered (barrier, destroy) so gloo exits cleanly. Under torchrun every restart attempt
rendezvouses under its own key prefix, so `--max-restarts N` resumes on its own. How a failure ends a
rank (one line, exit 1 at once, the lock on --save given back) is engine/run/guard.py.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import warnings

from engine.cli import parse_config
from engine.config import ConfigError
from engine.config.fields import Problems
from engine.resolve import resolve
from engine.run.device import device_and_backend, gpu_index
from engine.run.guard import Guard, fail, restart_store
from engine.validation import validate


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _pick_device(cfg, world: int) -> tuple:
    """(device, backend) from --device and --distributed-backend (engine/run/device.py): on CUDA this rank's GPU,
    its own under nccl, shared under gloo; on the CPU OMP_NUM_THREADS threads where the user set it, this
    process's share of the cores otherwise."""
    import torch
    device_type, backend = device_and_backend(cfg.training.device, cfg.parallel.distributed_backend,
                                               torch.cuda.is_available())
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if device_type == "cuda":
        torch.cuda.set_device(gpu_index(backend, _env_int("LOCAL_RANK", 0), local_world, torch.cuda.device_count()))
        return f"cuda:{torch.cuda.current_device()}", backend
    if not os.environ.get("OMP_NUM_THREADS"):  # the user's setting wins; torch has already applied it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    return "cpu", backend


def _configure(argv, world: int) -> tuple:
    """Flags -> (resolved config, device, backend); the mistakes are one ConfigError, a line each, raised before
    any process group exists: those of the command line and those of the settings together."""
    problems = Problems()
    cfg = parse_config(argv, problems)
    if cfg.parallel.gpus_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
        cfg.parallel.gpus_per_node = _env_int("LOCAL_WORLD_SIZE", world)
    validate(cfg, world, problems)
    problems.raise_all()
    resolve(cfg, world)
    device, backend = _pick_device(cfg, world)
    return cfg, device, backend


def _init_process_group(cfg, backend: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if "MASTER_ADDR" not in os.environ:  # plain `python launch/pretrain_gpt.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                            store=restart_store(rank, world, timeout))


def _teardown(ctx, guard: Guard) -> None:
    """Every rank waits for the others, then the groups go; a peer that died meanwhile ends this rank at once.

    The lock on --save goes first: every write of this rank is done, and a process group torn down after its
    torchrun agent died can abort the process in C++ (gloo), past any Python cleanup."""
    import torch.distributed as dist

    from engine.parallel import comm
    guard.release()
    if dist.is_initialized():
        try:
            comm.barrier()
            if ctx is not None:
                ctx.destroy()
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a peer that died after this rank finished
            guard.die(e, "the teardown barrier (all ranks)")
    guard.release()


def main(argv=None) -> int:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        cfg, device, backend = _configure(argv, world)
        guard = Guard(rank, cfg.parallel.distributed_timeout_minutes).take_lock(cfg.checkpoint.save)
    except ConfigError as e:
        return fail(str(e), rank, before_groups=True)
    # choices made for the user (e.g. --data-path over mock data), then the defaults that are not Megatron-LM's
    for note in [*cfg.notices, *filter(None, [cfg.defaults_note])] if rank == 0 else ():
        print(f"pretrain_gpt.py: note: {note}", flush=True)
    guard.watch_parent()

    import torch

    from engine.checkpoint.saver import SaveFailed
    from engine.layout import Layout
    from engine.parallel.topology import context_for, layout_table
    from engine.report import banner, report_arguments
    from engine.training import Trainer

    _init_process_group(cfg, backend, rank, world)
    guard.start_heartbeat(world)  # who stopped, and where, when a collective fails
    guard.log_dir = cfg.logging.tensorboard_dir or cfg.checkpoint.save  # a failing rank's stack goes there
    ctx, par = None, cfg.parallel
    try:
        ctx = context_for(Layout.from_config(cfg, world), rank, gpus_per_node=par.gpus_per_node,
                          timeout_minutes=par.distributed_timeout_minutes, seed=cfg.training.seed,
                          device_type=torch.device(device).type, cp_comm_type=par.cp_comm_type)
        guard.where = "building the model, optimizer and data"
        log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
        report_arguments(cfg, rank, log)  # rank 0: the resolved arguments, printed and saved beside the metrics
        with warnings.catch_warnings():
            if rank != 0:
                warnings.simplefilter("ignore")
            trainer = Trainer(cfg, ctx, device, log=log)
            guard.where = trainer.phase  # from here on, the failure line names the trainer's phase
            guard.stacks_on_signal(signal.SIGTERM)  # after the pre-emption handler: a blocked rank's stack too
            trainer.start()
            with trainer.phase("the start-up banner (all_gather_object)", "all"):
                table = layout_table(world, cfg.tp, cfg.pp, par.gpus_per_node, cfg.cp)
                log(banner(cfg, ctx, trainer.chunks, device, table))
            trainer.train()
    except ConfigError as e:
        return fail(str(e), rank)
    except SaveFailed as e:  # every rank raised it after agreeing: one line, and the teardown barrier is safe
        return guard.save_failed(e)
    except Exception as e:  # noqa: BLE001 - every failure must end this rank now, never hang in teardown
        guard.die(e)
    finally:
        _teardown(ctx, guard)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain a GPT/Llama model: `torchrun [torchrun flags] launch/pretrain_gpt.py [--config F.yaml] [flags]`.

Order of work: parse and validate every flag (a user mistake ends here with one line and exit 2,
before any process group exists), pick the device and backend, build the process groups, then hand
over to engine.training.Trainer. Teardown is ordered (barrier, destroy) so gloo exits cleanly.
"""
from __future__ import annotations

import datetime
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import ConfigError, parse_config, validate  # noqa: E402


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _fail(message: str, rank: int) -> int:
    if rank == 0:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        cfg = parse_config(argv)
        if cfg.parallel.gpus_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
            cfg.parallel.gpus_per_node = _env_int("LOCAL_WORLD_SIZE", world)
        validate(cfg, world)
        from engine.training import resolve_vocab_size
        if not cfg.model.vocab_size:
            cfg.model.vocab_size = resolve_vocab_size(cfg)
    except ConfigError as e:
        return _fail(str(e), rank)

    import torch
    import torch.distributed as dist
    from engine.topology import build_context, layout_table
    from engine.training import Trainer, banner

    use_cuda = cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is visible; use --device cpu or auto", rank)
    if use_cuda:
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        device, backend = f"cuda:{torch.cuda.current_device()}", "nccl"
    else:
        device, backend = "cpu", "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(_env_int("LOCAL_WORLD_SIZE", world), 1)))
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if "MASTER_ADDR" not in os.environ:  # plain `python launch/pretrain_gpt.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    ctx = None
    try:
        par = cfg.parallel
        ctx = build_context(world, rank, cfg.tp, cfg.pp, cfg.vpp, par.sequence_parallel, par.gpus_per_node,
                            par.distributed_timeout_minutes, cfg.training.seed, "cuda" if use_cuda else "cpu")
        log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
        with warnings.catch_warnings():
            if rank != 0:
                warnings.simplefilter("ignore")
            trainer = Trainer(cfg, ctx, device, log=log)
            log(banner(cfg, ctx, trainer, layout_table(world, cfg.tp, cfg.pp, par.gpus_per_node)))
            trainer.train()
    except ConfigError as e:
        return _fail(str(e), rank)
    finally:
        if dist.is_initialized():
            dist.barrier()
            if ctx is not None:
                ctx.destroy()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput of one config on this device, and the engine's overhead over a plain PyTorch loop.

    python benchmarks/train.py --config configs/gpt-tiny.yaml --mock-data [pretrain_gpt.py flags]
                               [--iters 20] [--warmup 3] [--json]

One process, one device (tp 1, pp 1, dp 1). Two loops train the same model from the same initial weights
on the same batches, alternating step by step so that a change in machine load hits both alike:
- engine: `engine.training.Trainer.iterate()`, i.e. everything a real run does per iteration (batch,
  pipeline schedule, grad buffer, mixed-precision AdamW, clipping, stability guard, pre-emption check);
- plain: `GPTModel` + `torch.optim.AdamW` + `clip_grad_norm_` (autocast for --bf16/--fp16), nothing else.
Reported per loop: median step time, tokens/s, model TFLOP/s and MFU (engine.flops), and the ratio
engine / plain step time. The peak for MFU is --peak-tflops, else the CUDA device's preset, else (CPU)
a measured fp32 matmul rate of this machine, labelled as such. The two loss curves are also compared:
they agree to rounding, which shows both loops do the same work.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time

from engine.cli import parse_config
from engine.config import ConfigError
from engine.resolve import resolve
from engine.validation import validate


def parse(argv):
    """(own options, validated one-device Config) from the command line; ConfigError on bad input."""
    p = argparse.ArgumentParser(prog="benchmarks/train.py", add_help=False)
    p.add_argument("--iters", type=int, default=20, help="measured iterations per loop")
    p.add_argument("--warmup", type=int, default=3, help="iterations run first and not measured")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--help", "-h", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        print(__doc__)
        sys.exit(0)
    if own.iters < 1 or own.warmup < 0:
        raise ConfigError(f"--iters {own.iters} --warmup {own.warmup}: need at least 1 measured iteration "
                          f"and a non-negative warm-up")
    cfg = parse_config(rest)
    if cfg.tp != 1 or cfg.pp != 1:
        raise ConfigError(f"--tp {cfg.tp} --pp {cfg.pp}: the benchmark runs one process on one device; use "
                          f"--tp 1 --pp 1 (multi-GPU throughput is in pretrain_gpt.py's log)")
    validate(cfg, 1)
    resolve(cfg, 1)
    cfg.training.train_iters = own.warmup + own.iters
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logging.eval_interval = cfg.logging.metrics_file = cfg.logging.tensorboard_dir = None
    cfg.logging.profile = False
    return own, cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured_matmul_tflops(device, dtype, size: int = 1024, threads=None) -> float:
    """Best rate of a size^3 matmul here (on `threads` CPU threads if given): the reference peak where no
    preset exists (CPU)."""
    import torch
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(3):
                a @ b
            best = max(best, 3 * 2 * size ** 3 / (time.perf_counter() - t0) / 1e12)
        return best
    finally:
        torch.set_num_threads(saved)


class PlainLoop:
    """The same model trained the textbook way: forward, backward, clip, AdamW, on the same batches."""

    def __init__(self, cfg, ctx, trainer, device):
        import torch

        from engine.precision import model_dtype
        self.cfg, self.trainer, self.device = cfg, trainer, device
        self.autocast = model_dtype(cfg) if model_dtype(cfg) != torch.float32 else None
        self.model = self.build_model(ctx)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        fast = {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.optim.lr,
                                     betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2), eps=cfg.optim.adam_eps, **fast)
        self.params = params

    def build_model(self, ctx):
        """The fp32 model this loop trains (a subclass trains another implementation of the same one)."""
        import torch

        from engine.model import GPTModel
        cfg = self.cfg
        return GPTModel(cfg.model, ctx, vocab_size=cfg.model.vocab_size, z_loss_weight=cfg.optim.z_loss_weight,
                        seed=cfg.training.seed, device=self.device, dtype=torch.float32)

    def loss(self, batch):
        """One microbatch's mean token loss."""
        from engine.loss import mean_loss
        return mean_loss(self.model(tokens=batch["tokens"], labels=batch["labels"]), batch["loss_mask"])

    def batches(self, iteration: int) -> list:
        """The microbatches of `iteration`: the samples the engine's sampler hands out at that step."""
        from engine.data import make_batch
        tr = self.cfg.training
        gbs, mbs = tr.global_batch_size, tr.micro_batch_size
        first = iteration * gbs
        return [make_batch(self.trainer.train_ds, list(range(i, i + mbs)), device=self.device)
                for i in range(first, first + gbs, mbs)]

    def step(self, iteration: int) -> float:
        import torch

        from engine.optim import lr_at
        cfg, tr = self.cfg, self.cfg.training
        batches = self.batches(iteration)
        total = 0.0
        for batch in batches:
            with torch.autocast(torch.device(self.device).type, dtype=self.autocast, enabled=self.autocast is not None):
                loss = self.loss(batch)
            (loss / len(batches)).backward()
            total += loss.item()
        if cfg.optim.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.clip_grad)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(iteration, cfg.optim, tr.train_iters)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / len(batches)


@contextlib.contextmanager
def process_group(use_cuda: bool):
    """A process group of one on this machine (the engine's collectives need one even at world size 1)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def engine_trainer(cfg, device) -> tuple:
    """(context, started Trainer) of a one-device run of `cfg`, inside `process_group`. When done, the caller puts
    back the stop-signal handlers the trainer installed (`trainer.preemption.restore()`; only `train()` does it
    itself): left behind, this process and every process it forks would ignore SIGTERM, and a forked pool's
    shutdown once hung the test suite so."""
    import torch

    from engine.layout import Layout
    from engine.parallel.topology import context_for
    from engine.training import Trainer
    ctx = context_for(Layout.from_config(cfg, 1), 0, seed=cfg.training.seed, device_type=torch.device(device).type)
    trainer = Trainer(cfg, ctx, device, log=lambda _msg: None)
    trainer.start()
    return ctx, trainer


def run(own, cfg) -> dict:
    import torch

    from engine import flops
    from engine.metrics import peak_tflops
    from engine.precision import model_dtype

    use_cuda = cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
    if cfg.training.device == "cuda" and not use_cuda:
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    device = "cuda:0" if use_cuda else "cpu"
    dtype = model_dtype(cfg)
    peak = peak_tflops(cfg, torch.device(device))
    peak_source = "--peak-tflops" if cfg.logging.peak_tflops else "device preset"
    measured = peak is None
    if measured:  # measured before and after the loops, the best kept: the machine may be busy meanwhile
        peak = measured_matmul_tflops(device, dtype)
        peak_source = f"measured {str(dtype).replace('torch.', '')} 1024^3 matmul on this machine"
    with process_group(use_cuda):
        ctx, trainer = engine_trainer(cfg, device)
        plain = PlainLoop(cfg, ctx, trainer, device)
        sync = torch.cuda.synchronize if use_cuda else (lambda: None)
        times = {"engine": [], "plain": []}
        losses = {"engine": [], "plain": []}

        for i in range(cfg.training.train_iters):
            order = ("engine", "plain") if i % 2 == 0 else ("plain", "engine")
            for name in order:
                sync()
                t0 = time.perf_counter()
                if name == "engine":
                    trainer.iterate()
                    loss = trainer.last_record["lm_loss"]
                else:
                    loss = plain.step(i)
                sync()
                if i >= own.warmup:
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(loss)
        trainer.preemption.restore()
        ctx.destroy()

    if measured:
        peak = max(peak, measured_matmul_tflops(device, dtype))
    seq, gbs = cfg.model.seq_length, cfg.training.global_batch_size
    model_flops = flops.flops_per_iteration(cfg.model, gbs, seq)
    name = torch.cuda.get_device_name(0) if use_cuda else f"CPU ({torch.get_num_threads()} threads)"
    out = {"device": name, "dtype": str(dtype).replace("torch.", ""), "global_batch_size": gbs, "seq_length": seq,
           "iters": own.iters, "warmup": own.warmup, "peak_tflops": peak, "peak_source": peak_source}
    for loop in ("engine", "plain"):
        step = statistics.median(times[loop])
        tflops = model_flops / step / 1e12
        out[loop] = {"step_time_s": step, "tokens_per_sec": gbs * seq / step, "tflops": tflops, "mfu": tflops / peak,
                     "losses": losses[loop]}
    out["engine_over_plain"] = out["engine"]["step_time_s"] / out["plain"]["step_time_s"]
    out["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses["engine"], losses["plain"]))
    return out


def table(r: dict) -> str:
    lines = [f"device: {r['device']}, {r['dtype']}; global batch {r['global_batch_size']} x {r['seq_length']} tokens; "
             f"{r['iters']} measured iterations after {r['warmup']} warm-up",
             f"peak for MFU: {r['peak_tflops']:.3g} TFLOP/s ({r['peak_source']})",
             f"{'loop':<8}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}"]
    for loop in ("engine", "plain"):
        x = r[loop]
        lines.append(f"{loop:<8}{1000 * x['step_time_s']:>10.2f}{x['tokens_per_sec']:>12.0f}{x['tflops']:>10.4f}"
                     f"{100 * x['mfu']:>7.1f}%")
    lines.append(f"engine / plain step time: {r['engine_over_plain']:.3f}x; loss curves differ by at most "
                 f"{r['max_loss_difference']:.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    try:
        own, cfg = parse(argv)
        result = run(own, cfg)
    except ConfigError as e:
        print(f"benchmarks/train.py: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if own.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a test function on N gloo ranks in separate processes, with a hard timeout.

`run_ranks(fn, world_size, *args)` calls `fn(rank, world_size, *args)` on every rank after the
default process group exists, and returns the per-rank results. A rank that raises fails the test with
its traceback. A test that does not finish within `timeout` seconds fails after printing every rank's
Python stack (faulthandler on SIGUSR1), then the ranks are killed: CI never hangs.

Spawning ranks costs seconds (mostly importing torch), so ranks are kept in a pool per world size and
reused across tests; a pool that timed out or lost a rank is discarded and a fresh one is started.

gloo sometimes aborts at interpreter exit after a clean teardown ("terminate called without an
active exception"). Results are collected before teardown, so an abort at exit is tolerated after
success, while a rank that dies or raises during a test is always a failure.

Beside the pool, the helpers every parallel test compares with: `grad_buffer` (the engine's own gradient
reduction for tests that run backward themselves), `full_grad` (a parameter's whole gradient,
gathered over TP, vocabulary padding removed), `whole_grad` (the same, expert parameters gathered over EP) and
`tp2_pp2_logits_error` (a checkpoint's logits at tp 2 x pp 2 against a reference's); and `train_logged` (a
Trainer run in a rank, its log lines kept, its signal handler and process groups undone).
"""
from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback

DEFAULT_TIMEOUT = float(os.environ.get("TERNION_TEST_TIMEOUT", "180"))
# The defaults are Megatron-LM's dropout of 0.1; tests that compare numbers across layouts or with an oracle
# train without it, and say so with these ModelConfig fields.
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}


def grad_buffer(chunks: list, ctx, num_microbatches: int = 1):
    """engine.optim.GradBuffer over `chunks`, started for one step of `num_microbatches` backward passes.

    After them, `.finish()` leaves in each parameter's `main_grad` what the optimizer would read: the mean
    over dp, sequence-parallel partial gradients summed over TP, tied embedding copies summed."""
    from engine.optim import GradBuffer
    buffer = GradBuffer(list(chunks), ctx, distributed=False, overlap=False)
    buffer.start_step(num_microbatches)
    return buffer


def full_grad(p, ctx, grad=None):
    """The whole gradient of parameter `p` (`grad`, else p.main_grad, else p.grad): its TP shards gathered,
    the vocabulary padding removed, so every layout can be compared with one rank."""
    import torch
    import torch.distributed as dist

    from engine.parallel.layers import spec_of
    spec = spec_of(p)
    g = grad if grad is not None else getattr(p, "main_grad", None)
    g = g if g is not None else (p.grad if p.grad is not None else torch.zeros_like(p))
    if spec.tp_axis is not None and ctx.tp_size > 1:
        parts = [torch.empty_like(g) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, g.contiguous(), group=ctx.tp_group)
        g = torch.cat(parts, dim=spec.tp_axis)
    return g[:spec.valid_rows] if spec.valid_rows is not None else g


def whole_grad(p, ctx):
    """full_grad, and for an expert parameter the other EP ranks' experts gathered too (along dim 0, the
    experts' axis), so an MoE layout's gradients compare with one rank's."""
    import torch
    import torch.distributed as dist

    from engine.parallel.layers import spec_of
    g = full_grad(p, ctx)
    if spec_of(p).ep_axis is not None and ctx.ep_size > 1:
        parts = [torch.empty_like(g) for _ in range(ctx.ep_size)]
        dist.all_gather(parts, g.contiguous(), group=ctx.ep_group)
        g = torch.cat(parts, dim=0)
    return g


def train_logged(cfg, ctx) -> list:
    """Train `cfg` with the Trainer in this rank on `ctx`; the lines it logged. Whatever happens, the trainer's
    SIGTERM handler is put back (a later test in this pool rank must not inherit it) and `ctx` is destroyed."""
    from engine.training import Trainer
    lines, trainer = [], None
    try:
        trainer = Trainer(cfg, ctx, "cpu", log=lines.append)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.preemption.restore()
        ctx.destroy()
    return lines


def tp2_pp2_logits_error(rank, world, cfg, ckpt, x, want, vocab: int, sequence_parallel=False) -> list:
    """Checkpoint `ckpt` loaded into `cfg`'s model at tp 2 x pp 2 (4 ranks), its logits of tokens `x` against
    `want`: the first stage sends its hidden states to the last, whose ranks gather their vocabulary shards and
    compare the first `vocab` columns. On a last-stage rank [the largest difference]; [] on the first stage."""
    import torch
    import torch.distributed as dist

    from engine.checkpoint import load_checkpoint
    from engine.parallel.topology import build_context
    from engine.pipeline.partition import build_model_chunks
    errors = []
    ctx = build_context(world, rank, 2, 2, sequence_parallel=sequence_parallel)
    model = build_model_chunks(cfg, ctx)[0].eval()
    load_checkpoint(ckpt, [model], None, ctx, model_cfg=cfg.model)
    with torch.no_grad():
        if ctx.is_first_stage:
            dist.send(model(tokens=x).contiguous(), ctx.pp_ranks[1])
        else:
            hidden = torch.empty(x.shape[1] // ctx.seq_split, x.shape[0], cfg.model.hidden_size)
            dist.recv(hidden, ctx.pp_ranks[0])
            logits = model(hidden=hidden).contiguous()
            parts = [torch.empty_like(logits) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, logits, group=ctx.tp_group)
            errors.append((torch.cat(parts, -1)[..., :vocab] - want).abs().max().item())
    ctx.destroy()
    return errors


# The layout tests' SGD rate. Their references revisit three batches, so a high rate makes the loss curve
# chaotic: at 0.5 the untied 8-layer pipeline model (8 samples a step) and the CP Llama (4 samples) move by
# 2e-4 to 8e-4 over 20 steps when their weights carry 3e-7 of noise, which is what a different CPU's fp32
# rounding does, so a 1e-4 comparison passed or failed by chance. At 0.1 the same noise moves every such
# curve by under 1e-6 (test_harness.py asserts under 1e-5) and a 1e-4 difference is a real one.
SGD_LR = 0.1


def sgd_reference(model, batches, steps: int, lr: float = SGD_LR) -> tuple:
    """One rank's SGD training, for the layout tests to compare with: (mean loss per step, step-0 gradients).

    `batches(step)` gives the step's microbatches (dicts with tokens, labels and optionally loss_mask); each
    microbatch's loss is divided by their number, as the pipeline runner does."""
    import torch

    from engine.loss import mean_loss
    opt, curve, first = torch.optim.SGD(model.parameters(), lr=lr), [], {}
    for step in range(steps):
        opt.zero_grad()
        mbs, losses = batches(step), []
        for mb in mbs:
            loss = mean_loss(model(mb["tokens"], labels=mb["labels"]), mb.get("loss_mask"))
            (loss / len(mbs)).backward()
            losses.append(loss.item())
        curve.append(sum(losses) / len(losses))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return curve, first


class RankFailure(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, stack_dir, inbox, outbox):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    stack_file = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    outbox.put((rank, True, "ready"))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        stack_file.close()


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.stack_dir = tempfile.mkdtemp(prefix="ternion-stacks-")
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.stack_dir, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._wait_ready()

    def _wait_ready(self, timeout: float = 300.0) -> None:
        """A test's clock starts once every rank is up: spawning is slow on a loaded machine."""
        ready, deadline = 0, time.monotonic() + timeout
        while ready < self.world_size:
            try:
                self.outbox.get(timeout=0.5)
                ready += 1
            except queue.Empty:
                if time.monotonic() > deadline or not self.alive():
                    self.kill()
                    raise RankFailure(f"{self.world_size} ranks did not start within {timeout:.0f}s "
                                      f"(exit codes {[p.exitcode for p in self.procs]})") from None

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, timeout: float) -> list:
        for q in self.inboxes:
            q.put((fn, args))
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results and r not in errors]
                if dead:
                    self.kill()
                    raise RankFailure(f"rank(s) {dead} died (exit codes {[self.procs[r].exitcode for r in dead]}) "
                                      f"while running {fn.__name__}" + self._stacks()) from None
                if time.monotonic() > deadline:
                    stacks = self.dump_stacks()
                    self.kill()
                    if errors:
                        first = min(errors)
                        raise RankFailure(f"{fn.__name__} failed on rank(s) {sorted(errors)} and the others hung; "
                                          f"rank {first}:\n{errors[first]}\nstacks:\n{stacks}") from None
                    raise RankFailure(f"{fn.__name__} did not finish within {timeout:.0f}s on {self.world_size} ranks; "
                                      f"every rank's stack:\n{stacks}") from None
                continue
            (results if ok else errors)[rank] = value
            if not ok:
                # The other ranks may now wait forever in a collective: give them a moment only.
                deadline = min(deadline, time.monotonic() + 10)
        if errors:
            first = min(errors)
            raise RankFailure(f"{fn.__name__} failed on rank(s) {sorted(errors)}; rank {first}:\n{errors[first]}")
        return [results[r] for r in range(self.world_size)]

    def dump_stacks(self) -> str:
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in alive:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 15  # a loaded machine may take a while to schedule every rank
        paths = [os.path.join(self.stack_dir, f"rank{r}.txt") for r in alive]
        while time.monotonic() < deadline and not all(os.path.getsize(p) > 0 for p in paths if os.path.exists(p)):
            time.sleep(0.1)
        time.sleep(0.2)  # let the last lines of each dump land
        return self._stacks()

    def _stacks(self) -> str:
        out = []
        for r in range(self.world_size):
            path = os.path.join(self.stack_dir, f"rank{r}.txt")
            text = open(path).read() if os.path.exists(path) else ""
            out.append(f"--- rank {r} ---\n{text.strip() or '(no stack recorded)'}")
        return "\n".join(out)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        """Orderly teardown; an abort at exit after this point is the known gloo quirk and is ignored."""
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
        self.kill()


_pools: dict[int, RankPool] = {}


def _start_pool(world_size: int, attempts: int = 3) -> RankPool:
    """A fresh pool; a port taken by another process between choosing and binding it gets a retry."""
    for attempt in range(attempts):
        try:
            return RankPool(world_size)
        except RankFailure:
            if attempt == attempts - 1:
                raise


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _start_pool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except RankFailure:
        # A failed test can leave collectives unmatched: never reuse its ranks.
        pool.kill()
        _pools.pop(world_size, None)
        raise


def close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


atexit.register(close_pools)


_PEAK_RSS = """
import importlib, json, sys, threading, time
sys.path[:0] = json.loads(sys.argv[1])
main = getattr(importlib.import_module(sys.argv[2]), "main")

def rss_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))

base, peak, done = rss_kb(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_kb())
        time.sleep(0.001)
t = threading.Thread(target=sample)
t.start()
code = main(sys.argv[3:])
done.set()
t.join()
print(json.dumps({"code": code, "peak_bytes": (max(peak[0], rss_kb()) - base) * 1024}))
"""


def peak_rss_growth(module: str, argv: list, paths: list) -> tuple:
    """Run `module.main(argv)` in a fresh Python process (`paths` put first on its sys.path) and return
    (exit code, growth of its resident set over the call in bytes, sampled every millisecond, stderr)."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, json.dumps(paths), module, *argv], capture_output=True,
                         text=True)
    lines = out.stdout.strip().splitlines()
    if not lines:
        return None, None, out.stderr
    result = json.loads(lines[-1])
    return result["code"], result["peak_bytes"], out.stderr


def run_in_fresh_process(code: str, says: str, timeout: float = 300) -> str:
    """Run `code` in a new Python process from the repository's root (its engine importable), assert that it
    exits 0 having printed `says` (the tail of its stderr is the failure's message), and return what it printed. For checks that must not share
    this process's state: dynamo's caches and counters, inductor's import of triton (which breaks the interpreter
    the kernel tests use)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0 and says in done.stdout, done.stderr[-3000:]
    return done.stdout

"""`--overlap-param-gather` under ZeRO-1/2 (engine/optim/param_gather.py): the updated weights are all-gathered
bucket by bucket while the next forward runs, and the run is the same bit for bit as with the gather at the end
of the step: `optim` and `optim_grads`, a dense and an MoE model (whose expert buffer gathers over its own
replicas), a checkpoint saved and loaded while gathers are in flight, and a post-validated step (zero-bubble
schedules) undone and redone. One spawned group of 2 ranks runs every case.
"""
import pytest
import torch

from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.saver import save_checkpoint
from engine.config import Config, ModelConfig
from engine.layout import Layout
from engine.optim import build_optimizer, param_gather
from engine.optim.post_validation import PostValidator
from engine.parallel import comm
from engine.parallel.topology import context_for
from engine.pipeline.partition import build_model_chunks
from harness import NO_DROPOUT, run_ranks

VOCAB, SEQ, MICROBATCHES, STEPS, BUCKET = 64, 16, 2, 4, 3000


class _Late:
    """An all-gather that lands only when waited for, with the values it was launched with: what a slow network
    may do, made certain, so that a missing wait shows in the numbers (gloo's gathers on two ranks are
    usually done before anything reads the weights)."""

    def __init__(self, out, inp, group):
        self.out, self.inp, self.group = out, inp.clone(), group

    def wait(self):
        comm.all_gather_into(self.out, self.inp, group=self.group)

    @staticmethod
    def all_gather_into(out, inp, group=None, async_op=False):
        assert async_op
        return _Late(out, inp, group)


def _late(fn, *args):
    """fn(*args) with param_gather's all-gathers landing late (_Late)."""
    param_gather.comm = _Late
    try:
        return fn(*args)
    finally:
        param_gather.comm = comm


def _cfg(strategy: str, overlap: bool, moe: bool = False, clip: float = 1.0) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                            vocab_size=VOCAB, make_vocab_size_divisible_by=16)
    if moe:  # experts replicated over both ranks (ep 1): the expert buffer gathers too
        m = cfg.model
        m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 32
    par = cfg.parallel
    par.data_parallel_sharding_strategy, par.overlap_param_gather = strategy, overlap
    cfg.training.seed, cfg.optim.lr, cfg.optim.clip_grad = 3, 3e-3, clip
    return cfg


def _batches(rank: int, step: int) -> list:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [torch.randint(0, VOCAB, (1, SEQ + 1), generator=g) for _ in range(MICROBATCHES)]


def _forward_backward(chunk, opt, rank: int, step: int) -> float:
    opt.start_step(MICROBATCHES)
    total = 0.0
    for t in _batches(rank, step):
        loss = chunk(t[:, :-1], labels=t[:, 1:]).mean() / MICROBATCHES
        opt.scale_loss(loss).backward()
        total += loss.item()
    opt.finish_grad_sync()
    return total


def _weights(chunk, opt) -> dict:
    opt.wait_weights()
    return {name: p.detach().clone() for name, p in chunk.named_parameters()}


def _build(rank: int, world: int, cfg):
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB, dtype=torch.float32)
    return ctx, chunks, build_optimizer(cfg, chunks, ctx, bucket_numel=BUCKET)


def _curve(rank: int, world: int, cfg, ckpt: str = None) -> tuple:
    """(losses, final weights, trace). With `ckpt`: saved after step 1 and loaded after step 3, both while that
    step's gathers are in flight, then steps 2 and 3 run again (the curve has STEPS + 2 entries)."""
    ctx, chunks, opt = _build(rank, world, cfg)
    try:
        if opt.gather is not None:
            opt.gather.trace = []
        losses, steps = [], list(range(STEPS)) + ([2, 3] if ckpt else [])
        for i, step in enumerate(steps):
            losses.append(_forward_backward(chunks[0], opt, rank, step))
            assert opt.step(3e-3).updated
            if ckpt and i == 1:
                save_checkpoint(ckpt, 2, chunks, opt, ctx, cfg, {})
            if ckpt and i == 3:
                assert load_checkpoint(ckpt, chunks, opt, ctx)["iteration"] == 2
        trace = opt.gather.trace if opt.gather is not None else None
        return losses, _weights(chunks[0], opt), trace
    finally:
        ctx.destroy()


def _post_validated(rank: int, world: int, cfg) -> tuple:
    """STEPS steps as engine.stepping orders them under a zero-bubble schedule (each checked during the next
    step's forward and backward; clipping hits, the clip being low: the first step is undone and redone, and
    the steps after wait for their check): (losses, weights, reruns)."""
    ctx, chunks, opt = _build(rank, world, cfg)
    try:
        validator, losses, reruns = PostValidator(opt, ctx), [], 0
        for step in range(STEPS):
            loss = _forward_backward(chunks[0], opt, rank, step)
            settled = validator.settle()
            if settled is not None and settled.rerun:
                reruns += 1
                loss = _forward_backward(chunks[0], opt, rank, step)
            validator.step(3e-3, [loss])
            losses.append(loss)
        validator.settle()
        return losses, _weights(chunks[0], opt), reruns
    finally:
        ctx.destroy()


def _same(name: str, got: tuple, want: tuple) -> list:
    (losses, weights), (ref_losses, ref_weights) = got[:2], want[:2]
    problems = [] if losses == ref_losses else [f"{name}: losses {losses} vs {ref_losses}"]
    return problems + [f"{name}: weights of {k} differ" for k in ref_weights
                       if not torch.equal(weights[k], ref_weights[k])]


def _cases(rank: int, world: int, ckpt: str) -> tuple:
    """(problems, traces of the overlapped dense optim run, reruns of the post-validated runs)."""
    problems, traces = [], {}
    for strategy in ("optim", "optim_grads"):
        for moe in (False, True):
            name = f"{strategy}{' moe' if moe else ''}"
            want = _curve(rank, world, _cfg(strategy, False, moe))
            got = _curve(rank, world, _cfg(strategy, True, moe))
            problems += _same(name, got, want)
            traces[name] = got[2]
    resumed = _late(_curve, rank, world, _cfg("optim", True), f"{ckpt}/rank-group")
    ref = _curve(rank, world, _cfg("optim", False))
    problems += _same("save and load in flight", (resumed[0][:STEPS], resumed[1]), ref)
    if resumed[0][2:4] != resumed[0][4:]:
        problems.append(f"steps 2, 3 resumed: {resumed[0][4:]} vs {resumed[0][2:4]}")
    checked = [_post_validated(rank, world, _cfg("optim_grads", False, clip=0.05)),
               _late(_post_validated, rank, world, _cfg("optim_grads", True, clip=0.05))]
    problems += _same("post-validated", checked[1], checked[0])
    return problems, traces, [c[2] for c in checked]


def _in_flight_at_first_layer(trace: list) -> tuple:
    """(buckets launched and not yet waited for when the first layer's forward starts, buckets waited for after
    that, launched buckets never waited for) over the first step after a launch."""
    first = next(i for i, e in enumerate(trace) if e[0] == "launch")
    enter = next(i for i, e in enumerate(trace) if i > first and e[:3] == ("enter", 0, 1))
    launched = {e[1] for e in trace[first:enter] if e[0] == "launch"}
    waited = {e[1] for e in trace[first:enter] if e[0] == "wait"}
    later = {e[1] for e in trace[enter:] if e[0] == "wait"}
    never = sum(e[0] == "launch" for e in trace) - sum(e[0] == "wait" for e in trace)
    return launched - waited, later & (launched - waited), never


@pytest.mark.slow  # a spawned pair running every case: `make test` runs it, `make test-fast` not
def test_overlapped_param_gather_is_the_same_run_with_gathers_in_flight_during_forward(tmp_path):
    per_rank = run_ranks(_cases, 2, str(tmp_path), timeout=240)
    problems = sorted({p for problems, _, _ in per_rank for p in problems})
    assert not problems, "\n".join(problems)
    for _, traces, reruns in per_rank:
        assert reruns == [1, 1], reruns  # clipping hit: a step was undone, redone and republished
        for name, trace in traces.items():
            pending, waited_later, never = _in_flight_at_first_layer(trace)
            assert len(pending) >= 2 and waited_later == pending, (name, trace[:40])
            assert never == 0, name  # wait_weights() at the end waited for the last step's
        experts = {e[1][0] for e in traces["optim moe"] if e[0] == "launch"}
        assert experts == {0, 1}, experts  # the dense and the expert buffer both gather

"""End to end: the GPT model trained 20 AdamW steps under tp/pp/dp with the distributed optimizer
(with and without overlapped reduction) follows the single-rank run: loss within 1e-4, same grad norm.

The single-rank reference runs here in the test process, once; the ranks only compare against it.
"""
import pytest
import torch

from engine.config import Config, ModelConfig
from engine.layout import Layout
from engine.model import GPTModel
from engine.optim import build_optimizer, lr_at
from engine.parallel.topology import ParallelContext, context_for
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from harness import NO_DROPOUT, run_ranks

VOCAB, SEQ, MICRO, GLOBAL_MICROBATCHES, STEPS = 100, 16, 2, 4, 20


def _cfg(tp=1, pp=1, dp_optimizer=False, overlap=False, sp=False, recompute=None):
    cfg = Config()
    cfg.model = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                            make_vocab_size_divisible_by=16, recompute_granularity=recompute)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.sequence_parallel = sp
    cfg.parallel.use_distributed_optimizer, cfg.parallel.overlap_grad_reduce = dp_optimizer, overlap
    cfg.training.seed, cfg.training.train_iters = 5, STEPS
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_iters = 3e-3, 3e-4, 3
    cfg.optim.weight_decay, cfg.optim.clip_grad = 0.1, 0.5
    return cfg


def _microbatches(step):
    """Mock-data-like: tokens depend only on the seed and the global sample index."""
    out = []
    for i in range(GLOBAL_MICROBATCHES):
        rows = []
        for sample in range((step * GLOBAL_MICROBATCHES + i) * MICRO, (step * GLOBAL_MICROBATCHES + i + 1) * MICRO):
            g = torch.Generator().manual_seed(7 * 1_000_003 + sample % 24)  # 24 samples, revisited: loss falls
            rows.append(torch.randint(0, VOCAB, (SEQ + 1,), generator=g))
        t = torch.stack(rows)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:]})
    return out


def _single_rank_curve():
    cfg = _cfg()
    model = GPTModel(cfg.model, ParallelContext(), seed=cfg.training.seed, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ParallelContext())
    curve = []
    for step in range(STEPS):
        mbs = _microbatches(step)
        opt.start_step(len(mbs))
        losses = []
        for mb in mbs:
            loss = model(tokens=mb["tokens"], labels=mb["labels"]).mean()
            (loss / len(mbs)).backward()
            losses.append(loss.item())
        opt.finish_grad_sync()
        result = opt.step(lr_at(step, cfg.optim, STEPS))
        curve.append((sum(losses) / len(losses), result.grad_norm))
    return curve


def _train(rank, world, tp, pp, overlap, reference, recompute=None):
    cfg = _cfg(tp, pp, dp_optimizer=True, overlap=overlap, sp=tp > 1, recompute=recompute)
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
    try:
        chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
        opt = build_optimizer(cfg, chunks, ctx, bucket_numel=4000)
        per_rank = GLOBAL_MICROBATCHES // ctx.dp_size
        runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, MICRO, cfg.model.hidden_size), torch.float32,
                                "cpu")
        failures = []
        name = f"tp{tp} pp{pp} dp{ctx.dp_size} overlap={overlap} recompute={recompute}"
        for step in range(STEPS):
            mine = _microbatches(step)[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
            opt.start_step(len(mine))
            if pp > 1:
                loss = runner.run(mine)
            else:  # a plain loop over microbatches, no pipeline
                losses = []
                for mb in mine:
                    mb_loss = chunks[0](tokens=mb["tokens"], labels=mb["labels"]).mean()
                    (mb_loss / len(mine)).backward()
                    losses.append(mb_loss.detach())
                total = torch.stack(losses).mean().reshape(1)
                torch.distributed.all_reduce(total, group=ctx.dp_group)
                loss = total.item() / ctx.dp_size
            opt.finish_grad_sync()
            result = opt.step(lr_at(step, cfg.optim, STEPS))
            ref_loss, ref_norm = reference[step]
            if not result.updated or abs(loss - ref_loss) > 1e-4 or abs(result.grad_norm - ref_norm) > 1e-4 * ref_norm:
                failures.append(f"{name} step {step}: loss {loss:.6f} vs {ref_loss:.6f}, "
                                f"grad norm {result.grad_norm:.6f} vs {ref_norm:.6f}")
        return failures
    finally:
        ctx.destroy()


def _world4(rank, world, reference):
    return [f for tp in (2, 1) for overlap in (True, False) for f in _train(rank, world, tp, 1, overlap, reference)]


def _world8(rank, world, reference):
    """With and without overlap; full and selective recomputation must not move the curve either."""
    runs = ((True, None), (False, None), (True, "full"), (False, "selective"))
    return [f for overlap, recompute in runs for f in _train(rank, world, 2, 2, overlap, reference, recompute)]


@pytest.fixture(scope="module")
def reference():
    curve = _single_rank_curve()
    assert curve[-1][0] < curve[0][0] - 0.1, f"the reference must learn: {curve}"
    return curve


def test_tp2_dp2_and_dp4_distributed_optimizer_follow_single_rank(reference):
    problems = sorted({f for r in run_ranks(_world4, 4, reference, timeout=300) for f in r})
    assert not problems, "\n".join(problems)


@pytest.mark.slow  # 8 ranks, about 20 s on two cores; tp 2 x dp 2 and dp 4 stay in test-fast
def test_tp2_pp2_dp2_distributed_optimizer_follows_single_rank(reference):
    problems = sorted({f for r in run_ranks(_world8, 8, reference, timeout=480) for f in r})
    assert not problems, "\n".join(problems)

"""Activation recomputation (full and selective) changes memory, never results: dropout masks replay.
Rotary and learned positions both: with learned positions a layer's optional rotary input is None."""
import pytest
import torch

from engine.config import ModelConfig
from engine.model import GPTModel
from engine.parallel.topology import build_context
from harness import run_ranks


def cfg(granularity, num_layers=None, positions="rope"):
    return ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                       vocab_size=64, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                       position_embedding_type=positions, swiglu=True, hidden_dropout=0.2, attention_dropout=0.2,
                       attention_backend="local", recompute_granularity=granularity,
                       recompute_num_layers=num_layers)


def _loss_and_grads(rank, world, granularity, num_layers=None, sp=True, positions="rope"):
    ctx = build_context(world, rank, world, 1, sequence_parallel=sp, seed=21)  # seeds every stream afresh
    model = GPTModel(cfg(granularity, num_layers, positions), ctx, seed=5)
    model.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ctx.destroy()
    return loss.item(), grads


def _compare(rank, world, positions):
    base_loss, base = _loss_and_grads(rank, world, None, positions=positions)
    problems = []
    for granularity, layers in (("full", None), ("full", 1), ("selective", None)):
        loss, grads = _loss_and_grads(rank, world, granularity, layers, positions=positions)
        if loss != base_loss:
            problems.append(f"{granularity}/{layers}: loss {loss} vs {base_loss}")
        for name, g in grads.items():
            err = (g - base[name]).abs().max().item()
            if err > 1e-6 * base[name].abs().max().item():
                problems.append(f"{granularity}/{layers}: grad {name} differs by {err:.3g}")
    no_dropout_loss, _ = _loss_and_grads(rank, world, None, sp=False, positions=positions)
    if no_dropout_loss == base_loss:
        problems.append("sanity: a different stream should change the dropout masks")
    return problems


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
def test_full_and_selective_recompute_equal_no_recompute_with_dropout_under_tp2_sp(positions):
    for problems in run_ranks(_compare, 2, positions):
        assert problems == [], "\n".join(problems)

"""MoE routing against an independent oracle, megatron-core 0.16.1's router functions (moe_utils, CPU): the
top-k choice and combine weights (softmax, and sigmoid with an expert bias), the load-balancing loss and the
z-loss as the gradient they add to the router inside a whole model, and the aux-loss-free expert-bias update; and
that the bias update lowers the busiest expert's load. The layout tests compare each layout with one rank of the
same routing code, so a bug shared by every layout can only fail here. One process, about 5 s.
"""
import pytest
import torch

from engine.model import GPTModel
from engine.moe.stats import MoEStats, moe_blocks
from engine.parallel.topology import ParallelContext
from test_moe import SEQ, VOCAB, moe_cfg

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _router_inputs(model):
    """Record what each router sees: [T, h] tokens, in call order."""
    seen = []
    for _, block in moe_blocks([model]):
        block.router.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    return seen


def _oracle_routing(x, weight, cfg, bias=None):
    logits = x.double() @ weight.double().T
    probs, chosen = moe_utils.topk_routing_with_score_function(logits, cfg.moe_router_topk,
                                                               score_function=cfg.moe_router_score_function,
                                                               expert_bias=bias)
    return logits, probs, chosen


@pytest.mark.parametrize("score,bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
def test_choice_and_weights_are_megatrons(score, bias):
    cfg = moe_cfg(moe_router_score_function=score, moe_router_enable_expert_bias=bias, moe_router_topk=2)
    model = GPTModel(cfg, ParallelContext(), seed=3)
    router = moe_blocks([model])[0][1].router
    if bias:
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # moves the choice, not the weights
    torch.manual_seed(0)
    x = torch.randn(40, cfg.hidden_size)
    routing = router(x, torch.zeros(40, 2, dtype=torch.long), (20, 2))
    _, probs, chosen = _oracle_routing(x, router.weight.detach(), cfg, router.expert_bias)
    mine = torch.zeros(40, cfg.num_experts, dtype=torch.bool).scatter_(1, routing.experts, True)
    assert torch.equal(mine, chosen)
    assert torch.allclose(routing.weights.double(), probs.gather(1, routing.experts), atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balancing_and_z_losses_add_megatrons_gradient_to_the_router(score):
    """The router's gradient with the losses on minus with them off is d(aux + z)/d(router) of megatron-core's
    switch_load_balancing_loss_func and z_loss_func on the same logits (the LM loss part is the same in both)."""
    aux_coeff, z_coeff = 0.3, 0.05
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    grads, inputs = [], None
    for on in (False, True):
        cfg = moe_cfg(moe_router_score_function=score, moe_aux_loss_coeff=aux_coeff if on else 0.0,
                      moe_z_loss_coeff=z_coeff if on else None)
        model = GPTModel(cfg, ParallelContext(), seed=3).train()
        seen = _router_inputs(model)
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        router = moe_blocks([model])[0][1].router
        grads.append(router.weight.grad.double())
        inputs = seen[0]
    weight = router.weight.detach().double().requires_grad_(True)
    logits = inputs.double() @ weight.T
    _, _, chosen = _oracle_routing(inputs, weight.detach(), cfg)
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    if score == "sigmoid":  # megatron-core's compute_routing_scores_for_aux_loss
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    T, E, k = inputs.shape[0], cfg.num_experts, cfg.moe_router_topk
    aux = moe_utils.switch_load_balancing_loss_func(scores, chosen.sum(0).double(), T, k, E, aux_coeff)
    z = moe_utils.z_loss_func(logits, z_coeff)
    want, = torch.autograd.grad(aux + z, weight)
    got = grads[1] - grads[0]
    assert want.abs().max() > 1e-4  # the losses do move the router
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got - want).abs().max()


def _megatron_bias_update(counts, bias, rate, monkeypatch):
    """megatron-core's get_updated_expert_bias, its all-reduce over the data-parallel group made a no-op (one
    process holds every token here)."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **k: None)
    return moe_utils.get_updated_expert_bias(counts.clone(), bias.clone(), rate)


def test_the_expert_bias_update_is_megatrons_and_lowers_the_max_load(monkeypatch):
    cfg = moe_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.02, moe_router_topk=1)
    from engine.config import Config
    run = Config()
    run.model = cfg
    model = GPTModel(cfg, ParallelContext(), seed=3).train()
    block = moe_blocks([model])[0][1]
    block.router.expert_bias.fill_(0.0)[0] = 0.2  # a skewed start: expert 0 takes (nearly) every token
    stats = MoEStats(run, [model], ParallelContext(), "cpu")
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    loads = []
    for step in range(20):
        with torch.enable_grad():
            model(tokens)
        counts, before = block.stats.counts.clone(), block.router.expert_bias.detach().clone()
        loads.append(stats.finish_step()["moe_max_load"])
        if step < 3:
            want = _megatron_bias_update(counts.float(), before, cfg.moe_router_bias_update_rate, monkeypatch)
            assert torch.allclose(block.router.expert_bias, want), (block.router.expert_bias, want)
    assert loads[0] > 3 and max(loads[-5:]) < 2, loads

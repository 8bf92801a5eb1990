"""Mixture of experts against one rank (fp32, CPU, gloo): routing, dispatch, grouped GEMM, and whole models
trained with the engine's optimizer over ep x tp x pp x cp x dp layouts of 8 ranks."""
import math

import pytest
import torch
import torch.nn.functional as F

from engine.config import Config, ConfigError, ModelConfig
from engine.layout import Layout
from engine.model import GPTModel
from engine.moe.experts import grouped_matmul
from engine.moe.router import _keep_within_capacity
from engine.moe.stats import MoEStats
from engine.optim import build_optimizer
from engine.parallel.topology import ParallelContext, context_for
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.validation import validate
from harness import NO_DROPOUT, run_ranks, whole_grad

VOCAB, SEQ, MICRO = 64, 16, 2


def moe_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
                vocab_size=VOCAB, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                position_embedding_type="rope", swiglu=True, disable_bias_linear=True,
                untie_embeddings_and_output_weights=True, num_experts=4, moe_ffn_hidden_size=32,
                moe_layer_freq="[0]*1+[1]*1")
    return ModelConfig(**{**base, **NO_DROPOUT, **kw})


# ---------------------------------------------------------------- pieces on one process

def test_grouped_gemm_equals_the_loop_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=g)
    w = torch.randn(4, 16, 8, generator=g)
    sizes = [3, 0, 6, 4]  # an expert without tokens included
    outs, grads = [], []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_matmul(xi, wi, sizes, grouped)
        y.backward(torch.ones_like(y) * torch.arange(8.0))
        outs.append(y.detach())
        grads.append((xi.grad, wi.grad))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def _naive_moe(block, x):
    """The MoE block token by token: sum_k w_k expert_k(x_t), written without any dispatch."""
    cfg = block.cfg
    tokens = x.reshape(-1, x.shape[-1])
    logits = F.linear(tokens.float(), block.router.weight.float())
    scores = logits.softmax(-1) if cfg.moe_router_score_function == "softmax" else logits.sigmoid()
    top = scores.topk(cfg.moe_router_topk, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    f = cfg.moe_ffn_hidden_size
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for w, e in zip(weights[t], top.indices[t]):
            h = tokens[t] @ block.experts.fc1[e]
            h = F.silu(h[:f]) * h[f:]
            out[t] += w * (h @ block.experts.fc2[e])
    return out.view_as(x)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_block_equals_the_token_by_token_sum(score):
    model = GPTModel(moe_cfg(moe_router_score_function=score, moe_router_topk=2), ParallelContext(), seed=3)
    block = model.layers["1"].mlp
    x = torch.randn(SEQ, 2, 32, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(block(x, torch.arange(SEQ)), _naive_moe(block, x), atol=1e-5)


def test_capacity_keeps_the_heaviest_or_earliest_per_expert():
    # (expert, weight, sample, position)
    rows = torch.tensor([[0, 0.9, 0, 3], [0, 0.2, 0, 0], [0, 0.5, 0, 1], [1, 0.7, 0, 2], [0, 0.5, 0, 2]],
                        dtype=torch.float64)
    assert _keep_within_capacity(rows, 2, "probs").tolist() == [True, False, True, True, False]
    rows[4, 1] = 0.5 + 1e-7  # a rounding difference does not overtake the earlier token
    assert _keep_within_capacity(rows, 2, "probs").tolist() == [True, False, True, True, False]
    assert _keep_within_capacity(rows, 2, "position").tolist() == [False, True, True, True, False]
    rows[1, 2:] = torch.tensor([1.0, 0.0])  # samples first: sample 1's first token comes after sample 0's last
    assert _keep_within_capacity(rows, 2, "position").tolist() == [False, False, True, True, True]


def test_aux_loss_joins_backward_but_not_the_loss():
    cfg = moe_cfg(moe_aux_loss_coeff=0.5)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    losses, grads = [], []
    for coeff in (0.0, 0.5):
        model = GPTModel(moe_cfg(moe_aux_loss_coeff=coeff), ParallelContext(), seed=3).train()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["1"].mlp.router.weight.grad.clone())
    assert losses[0] == losses[1] and not torch.equal(grads[0], grads[1])
    assert cfg.moe_layers() == [1]


@pytest.mark.parametrize("par,flag", [
    (dict(expert_model_parallel_size=3), "--expert-model-parallel-size"),
    (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size"),
    (dict(expert_model_parallel_size=2, num_experts=None), "--expert-model-parallel-size"),
])
def test_bad_moe_layouts_are_one_clear_line(par, flag):
    cfg = Config()
    cfg.model = moe_cfg(num_experts=par.pop("num_experts", 4))
    cfg.data.mock_data = True
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 4)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_moe_layer_freq_is_checked():
    cfg = Config()
    cfg.model, cfg.data.mock_data = moe_cfg(moe_layer_freq="[0]*2"), True
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        validate(cfg, 1)
    cfg.model = moe_cfg(moe_router_topk=5)
    with pytest.raises(ConfigError, match="--moe-router-topk"):
        validate(cfg, 1)


# ---------------------------------------------------------------- whole models over layouts

def global_batch(step: int, n: int):
    g = torch.Generator().manual_seed(3000 + step % 3)
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return [{"tokens": t[i:i + MICRO, :-1], "labels": t[i:i + MICRO, 1:]} for i in range(0, n, MICRO)]


def _config(moe: dict, tp=1, pp=1, cp=1, ep=1, distributed=False) -> Config:
    cfg = Config()
    cfg.model = moe_cfg(**moe)
    par = cfg.parallel
    par.tensor_model_parallel_size, par.pipeline_model_parallel_size = tp, pp
    par.context_parallel_size, par.expert_model_parallel_size = cp, ep
    par.sequence_parallel, par.use_distributed_optimizer = tp > 1, distributed
    cfg.training.seed, cfg.optim.lr, cfg.optim.clip_grad, cfg.optim.weight_decay = 9, 3e-3, 1.0, 0.0
    return cfg


def _train(cfg, ctx, steps: int, microbatches: int, dp_rank: int = 0, dp: int = 1) -> tuple:
    """Loss, grad norm and MoE metrics per step and the step-0 gradients, with the engine's optimizer."""
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    opt, stats = build_optimizer(cfg, chunks, ctx), MoEStats(cfg, chunks, ctx, "cpu")
    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, MICRO, 32), torch.float32, "cpu")
    history, first = [], {}
    for step in range(steps):
        mbs = global_batch(step, microbatches * MICRO * dp)
        opt.start_step(microbatches)
        loss = runner.run(mbs[dp_rank * microbatches:(dp_rank + 1) * microbatches])
        opt.finish_grad_sync()
        metrics = stats.finish_step()
        if step == 0 and not cfg.parallel.use_distributed_optimizer:
            first = {n: whole_grad(p, ctx).clone() for c in chunks for n, p in c.named_parameters() if p.requires_grad}
        result = opt.step(cfg.optim.lr)
        history.append((loss, result.grad_norm, metrics))
    return history, first


def _layout(rank, world, moe, tp, pp, cp, ep, distributed, steps, microbatches):
    cfg = _config(moe, tp, pp, cp, ep, distributed)
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=9)
    out = _train(cfg, ctx, steps, microbatches, ctx.dp_rank, ctx.dp_size)
    ctx.destroy()
    return out


_REFERENCES: dict = {}


def reference(moe: dict, steps: int, microbatches: int) -> tuple:
    key = (tuple(sorted(moe.items())), steps, microbatches)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train(_config(moe), ParallelContext(), steps, microbatches)
    return _REFERENCES[key]


def compare(results, ref) -> list:
    (ref_hist, ref_grads), failures = ref, []
    for rank, (hist, grads) in enumerate(results):
        (loss0, _, _), (ref0, _, _) = hist[0], ref_hist[0]
        if abs(loss0 - ref0) > 1e-5:
            failures.append(f"rank {rank}: loss {loss0} vs {ref0}")
        curve = max(abs(a[0] - b[0]) for a, b in zip(hist, ref_hist))
        norms = max(abs(a[1] - b[1]) for a, b in zip(hist, ref_hist))
        if curve > 1e-4 or norms > 1e-4:
            failures.append(f"rank {rank}: curve differs by {curve:.3g}, grad norm by {norms:.3g}")
        for (_, _, m), (_, _, want) in zip(hist, ref_hist):
            if m["moe_dropped"] != want["moe_dropped"] or abs(m["moe_max_load"] - want["moe_max_load"]) > 1e-9:
                failures.append(f"rank {rank}: routing differs: {m} vs {want}")
                break
        for name, got in grads.items():
            want = ref_grads[name]
            err = (got - want).abs().max().item()
            if err > 1e-5 * want.abs().max().item() + 1e-8:
                failures.append(f"rank {rank}: grad {name} err {err:.3g}")
    if not ref_hist[-1][0] < ref_hist[0][0]:
        failures.append("the reference loss did not fall")
    return failures


MOE_LAYOUTS = [  # (name, routing, tp, pp, cp, ep, distributed optimizer): 8 ranks, dp = 8 / (tp pp cp)
    ("ep2-top2-softmax-shared-aux", dict(moe_router_topk=2, moe_shared_expert_intermediate_size=32,
                                         moe_aux_loss_coeff=1e-2), 1, 1, 1, 2, True),
    ("ep4-top1-sigmoid-bias", dict(moe_router_topk=1, moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                                   moe_router_load_balancing_type="none"), 1, 1, 1, 4, False),
    ("tp2sp-ep2-top2-capacity-seqaux", dict(moe_router_topk=2, moe_expert_capacity_factor=1.0,
                                            moe_router_load_balancing_type="seq_aux_loss",
                                            moe_aux_loss_coeff=1e-2), 2, 1, 1, 2, False),
    ("pp2-ep2-top2-sigmoid-bias-shared-z", dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                                                moe_router_enable_expert_bias=True, moe_z_loss_coeff=1e-3,
                                                moe_shared_expert_intermediate_size=32), 1, 2, 1, 2, False),
    ("tp2sp-pp2-ep2-top2-capacity-position", dict(moe_router_topk=2, moe_expert_capacity_factor=1.25,
                                                  moe_token_drop_policy="position", moe_aux_loss_coeff=1e-2),
     2, 2, 1, 2, True),
    ("cp2-ep2-top1-capacity", dict(moe_router_topk=1, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=1e-2),
     1, 1, 2, 2, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("moe,tp,pp,cp,ep,distributed", [c[1:] for c in MOE_LAYOUTS], ids=[c[0] for c in MOE_LAYOUTS])
def test_moe_layouts_equal_one_rank(moe, tp, pp, cp, ep, distributed):
    dp = 8 // (tp * pp * cp)
    microbatches = 2
    results = run_ranks(_layout, 8, moe, tp, pp, cp, ep, distributed, 20, microbatches, timeout=300)
    problems = compare(results, reference(moe, 20, microbatches * dp))
    assert not problems, "\n".join(problems[:20])
    assert math.isfinite(results[0][0][-1][0])

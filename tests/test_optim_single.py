"""The optimizer on one rank: AdamW against PyTorch's, fp32 accumulation, precisions, fp16 skips, state."""
import copy

import pytest
import torch
from torch import nn

from engine.config import Config
from engine.layout import Layout
from engine.optim import LossScaler, build_optimizer
from engine.parallel.topology import ParallelContext


class Tiny(nn.Module):
    """Two matrices, a bias and a norm-like vector; `shared` is used twice (a tied weight)."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(6, 5, generator=g).to(dtype))
        self.b1 = nn.Parameter(torch.randn(6, generator=g).to(dtype))
        self.w2 = nn.Parameter(torch.randn(4, 6, generator=g).to(dtype))
        self.norm = nn.Parameter(torch.ones(4, dtype=dtype))


def _cfg(**kw):
    cfg = Config()
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.clip_grad = 1e-2, 0.1, 1.0
    for key, value in kw.items():
        section = next(s for s in ("training", "parallel", "optim") if hasattr(getattr(cfg, s), key))
        setattr(getattr(cfg, section), key, value)
    return cfg


def _grads(model, step, micro, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return {n: torch.randn(p.shape, generator=g) * scale for n, p in model.named_parameters()}


def _backward(model, grads, factor=1.0):
    """A backward whose gradient for each parameter is exactly grads[name] (cast to its dtype)."""
    loss = sum((p * (grads[n] * factor).to(p.dtype)).sum() for n, p in model.named_parameters())
    loss.backward()


def _reference_adamw(model, lr, wd):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([dict(params=decay, weight_decay=wd), dict(params=rest, weight_decay=0.0)],
                             lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)


@pytest.mark.parametrize("overlap,distributed", [(False, False), (True, False), (True, True)])
def test_fp32_steps_match_torch_adamw_with_clipping(overlap, distributed):
    model, ref = Tiny(), Tiny()
    cfg = _cfg(overlap_grad_reduce=overlap, use_distributed_optimizer=distributed)
    opt = build_optimizer(cfg, [model], ParallelContext.virtual(layout=Layout.from_config(cfg, 1)), bucket_numel=20)
    assert len(opt.buffer.buckets) >= 2
    ref_opt = _reference_adamw(ref, 1e-2, 0.1)
    for step in range(4):
        lr = 1e-2 * (step + 1) / 4
        opt.start_step(3)
        full = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        for m in range(3):
            grads = _grads(model, step, m, scale=2.0 if step % 2 else 0.01)  # clipped on odd steps only
            _backward(model, grads, 1 / 3)
            for n in full:
                full[n] += grads[n] / 3
        opt.finish_grad_sync()
        for n, p in model.named_parameters():
            assert p.grad is None, "the hook frees p.grad once added to main_grad"
            torch.testing.assert_close(p.main_grad, full[n], rtol=1e-6, atol=1e-6)
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in full.values()])).item()
        result = opt.step(lr)
        assert result.updated and result.loss_scale == 1.0
        assert result.grad_norm == pytest.approx(norm, rel=1e-6)
        coef = min(1.0, 1.0 / (norm + 1e-6))
        assert (coef < 1.0) == bool(step % 2)
        for n, p in ref.named_parameters():
            p.grad = full[n] * coef
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{n} after step {step}")
    # Weight decay on matrices only (the reference above would diverge by lr*wd*p per step otherwise).
    decay, no_decay = opt.adam.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert sorted(m.numel() for m in decay["params"]) == [24, 30]
    assert sorted(m.numel() for m in no_decay["params"]) == [4, 6]


def test_bf16_accumulates_in_fp32_and_keeps_fp32_masters():
    model, ref = Tiny(torch.bfloat16), Tiny(torch.float32)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p.float())
    opt = build_optimizer(_cfg(bf16=True, clip_grad=0.0), [model], ParallelContext.virtual())
    ref_opt = _reference_adamw(ref, 1e-2, 0.1)
    assert opt.buffer.data.dtype == torch.float32
    for step in range(3):
        opt.start_step(4)
        full = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        for m in range(4):
            grads = {n: (g / 4).to(torch.bfloat16) for n, g in _grads(model, step, m).items()}
            _backward(model, grads)
            for n in full:
                full[n] += grads[n].float()  # what fp32 accumulation of the bf16 grads gives
        opt.finish_grad_sync()
        for n, p in model.named_parameters():
            assert p.main_grad.dtype == torch.float32
            torch.testing.assert_close(p.main_grad, full[n], rtol=0, atol=1e-7)
        assert opt.step(1e-2).updated
        for n, p in ref.named_parameters():
            p.grad = full[n]
        ref_opt.step()
        masters = {n: e["master"] for n, e in opt.state_dict()["params"].items()}
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.dtype == torch.bfloat16 and masters[n].dtype == torch.float32
            torch.testing.assert_close(masters[n].view_as(q), q.detach(), rtol=1e-6, atol=1e-6)
            assert torch.equal(p.detach(), masters[n].view_as(p).to(torch.bfloat16))


def test_fp16_inf_gradient_skips_step_and_halves_scale():
    model = Tiny(torch.float16)
    opt = build_optimizer(_cfg(fp16=True, initial_loss_scale=1024.0), [model], ParallelContext.virtual())
    opt.scaler = LossScaler(1024.0, dynamic=True, hysteresis=1, growth_interval=2)

    def run(step, inject):
        opt.start_step(1)
        loss = sum((p.float() * g).sum() for (n, p), g in zip(model.named_parameters(), _grads(model, step, 0).values()))
        opt.scale_loss(loss).backward()
        if inject:
            model.w2.main_grad[1, 2] = float("inf")
        opt.finish_grad_sync()
        return opt.step(1e-2)

    assert opt.scale_loss(torch.tensor(1.0)).item() == 1024.0
    first = run(0, inject=False)
    assert first.updated and first.loss_scale == 1024.0
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in _grads(model, 0, 0).values()])).item()
    assert first.grad_norm == pytest.approx(true_norm, rel=1e-3)  # reported without the loss scale
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    skipped = run(1, inject=True)
    assert not skipped.updated and skipped.loss_scale == 512.0
    assert skipped.grad_norm != skipped.grad_norm or skipped.grad_norm == float("inf")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        assert torch.equal(opt.state_dict()["params"][n]["master"], state["params"][n]["master"])
        assert torch.equal(opt.state_dict()["params"][n]["exp_avg"], state["params"][n]["exp_avg"])
    assert opt.state_dict()["step"] == 1
    assert run(2, inject=False).updated and run(3, inject=False).loss_scale == 1024.0  # regrows after 2 clean
    assert opt.state_dict()["step"] == 3


@pytest.mark.parametrize("hysteresis,bad", [({"hysteresis": 2}, "nan"), ({}, "inf")], ids=["hysteresis-2-nan",
                                                                                       "default-inf"])
def test_fp16_hysteresis_2_skips_the_first_overflow_and_halves_on_the_second(hysteresis, bad):
    """Megatron-LM's hysteresis 2, set or by default (the config's): the first overflow only skips, the second
    halves the scale; neither updates a weight."""
    model = Tiny(torch.float16)
    opt = build_optimizer(_cfg(fp16=True, initial_loss_scale=256.0, **hysteresis), [model], ParallelContext.virtual())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scales = []
    for _ in range(2):
        opt.start_step(1)
        _backward(model, {n: torch.full(p.shape, float(bad)) for n, p in model.named_parameters()})
        opt.finish_grad_sync()
        result = opt.step(1e-2)
        assert not result.updated
        scales.append(result.loss_scale)
    assert scales == [256.0, 128.0]
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_static_loss_scale_unscales_gradients():
    model, ref = Tiny(torch.float16), Tiny(torch.float16)
    opt = build_optimizer(_cfg(fp16=True, loss_scale=64.0, clip_grad=0.0), [model], ParallelContext.virtual())
    plain = build_optimizer(_cfg(fp16=True, loss_scale=1.0, clip_grad=0.0), [ref], ParallelContext.virtual())
    for o, m in ((opt, model), (plain, ref)):
        o.start_step(1)
        loss = sum((p.float() * g).sum() for p, g in zip(m.parameters(), _grads(m, 0, 0).values()))
        o.scale_loss(loss).backward()
        o.finish_grad_sync()
        result = o.step(1e-2)
        assert result.updated and result.loss_scale == (64.0 if o is opt else 1.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3)


def test_gradients_outside_a_step_and_extra_microbatches_are_errors():
    model = Tiny()
    opt = build_optimizer(_cfg(), [model], ParallelContext.virtual())
    with pytest.raises(RuntimeError, match="start_step"):
        _backward(model, _grads(model, 0, 0))
    opt.start_step(1)
    _backward(model, _grads(model, 0, 0))
    with pytest.raises(RuntimeError, match="more gradients"):
        _backward(model, _grads(model, 0, 1))


def test_tied_parameter_is_one_buffer_entry_with_summed_gradient():
    shared = nn.Parameter(torch.randn(3, 3))
    a, b = nn.Module(), nn.Module()
    a.weight, b.weight = shared, shared
    b.other = nn.Parameter(torch.randn(3))
    opt = build_optimizer(_cfg(), [a, b], ParallelContext.virtual())
    assert len(opt.buffer.params) == 2 and opt.buffer.data.numel() == 12
    opt.start_step(1)
    ((shared * 2).sum() + (shared * 3).sum() + b.other.sum()).backward()
    opt.finish_grad_sync()
    torch.testing.assert_close(shared.main_grad, torch.full((3, 3), 5.0))
    assert set(opt.state_dict()["params"]) == {"weight", "other"}


def test_state_dict_resume_continues_identically():
    def train(model, opt, steps):
        for step in steps:
            opt.start_step(2)
            for m in range(2):
                _backward(model, _grads(model, step, m), 0.5)
            opt.finish_grad_sync()
            opt.step(1e-2)

    cfg = _cfg(bf16=True)
    straight = Tiny(torch.bfloat16)
    opt = build_optimizer(cfg, [straight], ParallelContext.virtual())
    train(straight, opt, range(5))

    first = Tiny(torch.bfloat16)
    opt1 = build_optimizer(cfg, [first], ParallelContext.virtual())
    train(first, opt1, range(3))
    saved = copy.deepcopy(opt1.state_dict())
    resumed = Tiny(torch.bfloat16, seed=7)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), first.parameters()):
            p.copy_(q)
    opt2 = build_optimizer(cfg, [resumed], ParallelContext.virtual())
    opt2.load_state_dict(saved)
    assert opt2.state_bytes() == opt1.state_bytes() > 0
    train(resumed, opt2, range(3, 5))
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="reshard"):
        bad = copy.deepcopy(saved)
        bad["params"]["w1"]["range"] = (0, 7)
        bad["params"]["w1"]["exp_avg"] = bad["params"]["w1"]["exp_avg"][:7]
        opt2.load_state_dict(bad)


def test_foreach_adamw_is_bitwise_pytorchs():
    """engine.optim.adamw.ForeachAdamW (used off CUDA: torch.optim's constructor imports torch._dynamo, 2.8 s
    a process) against torch.optim.AdamW(foreach=True): the same bits after every step, weight decay on
    one group only, a parameter without a gradient left alone (its step count too), LR changed per step."""
    from engine.optim.adamw import ForeachAdamW, _init_state
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3, 4), (7,), (1,)]
    ours, ref = ([torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
                 for _ in range(2))

    def groups(params):
        return [dict(params=params[:2], weight_decay=0.1), dict(params=params[2:], weight_decay=0.0)]
    opt = ForeachAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _init_state(opt)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for step in range(6):
        for i, (a, b) in enumerate(zip(ours, ref)):
            grad = None if i == 3 and step < 2 else torch.randn(a.shape, generator=g) * 10 ** (step % 3 - 1)
            a.grad, b.grad = grad, None if grad is None else grad.clone()
        for group in opt.param_groups + ref_opt.param_groups:
            group["lr"] = 1e-2 / (step + 1)
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), step
        for a, b in zip(ours, ref):
            for key in ref_opt.state[b]:  # PyTorch creates the state at a tensor's first gradient
                assert torch.equal(opt.state[a][key], ref_opt.state[b][key]), (step, key)
    assert opt.state[ours[3]]["step"].item() == 4.0 and opt.state[ours[0]]["step"].item() == 6.0

"""Gradient-accumulation fusion (engine.parallel.grad_accumulation): the linears' weight gradients added into the
fp32 gradients by their products give what autograd's products and the grad buffer's adds give.

The fusion is CUDA-only in a run; here `supported` is switched on for fp32 weights on the CPU, so the fused code
runs for real: the same step with and without it, each model family's linears (a tied embedding, the stacked SwiGLU
weight, MLA's replicated projections, MTP's heads sharing the output layer, full recomputation), ZeRO-2's staging
and ZeRO-3's, a split backward's W pass, sequence parallelism's gathering linear on two ranks and a compiled
layer. fp32 products summed by addmm (beta 1) differ from a product then an add by rounding only: 1e-6 relative.
"""
import contextlib
from unittest import mock

import pytest
import torch

from engine.config import Config, ModelConfig
from engine.model import GPTModel
from engine.mtp import targets
from engine.optim import GradBuffer, build_optimizer
from engine.parallel import grad_accumulation, weight_grad_store
from engine.parallel.topology import ParallelContext
from harness import NO_DROPOUT, full_grad, run_ranks

VOCAB, SEQ = 100, 16


@contextlib.contextmanager
def fusing_on_cpu():
    """The fusion on for fp32 weights on the CPU, and given back after (a pooled rank outlives its test); yields the
    shapes of the products it makes."""
    calls, accumulate = [], grad_accumulation.accumulate

    def counted(target, x, dy):
        calls.append(tuple(target.shape))
        accumulate(target, x, dy)
    with mock.patch.object(grad_accumulation, "supported", lambda device, dtype: dtype == torch.float32), \
            mock.patch.object(grad_accumulation, "accumulate", counted):
        yield calls


@pytest.fixture
def fused_on_cpu():
    with fusing_on_cpu() as calls:
        yield calls


def _config(family: str) -> Config:
    cfg = Config()
    kw = dict(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
              make_vocab_size_divisible_by=16)
    if family == "llama-recompute":  # full recomputation: the linears run again inside backward, fused there
        kw.update(recompute_granularity="full")
    if family.startswith("llama"):
        kw.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, disable_bias_linear=True,
                  untie_embeddings_and_output_weights=True, num_query_groups=2)
    cfg.model = ModelConfig(**kw)
    if family == "deepseek":  # MLA, MoE with a shared expert, two MTP modules on the untied output layer
        m = cfg.model
        m.normalization, m.position_embedding_type, m.swiglu, m.ffn_hidden_size = "RMSNorm", "rope", True, 48
        m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, True
        m.multi_latent_attention, m.qk_layernorm, m.kv_lora_rank = True, True, 16
        m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 12, 8, 10
        m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq = 4, 2, 16, "[0,1]"
        m.moe_shared_expert_intermediate_size, m.mtp_num_layers = 16, 2
    return cfg


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(n)]


def _step(cfg, fuse: bool, microbatches: int = 2) -> tuple:
    """One step's reduced gradients (by name) with or without the fusion, and the model."""
    cfg.training.gradient_accumulation_fusion = fuse
    model = GPTModel(cfg.model, ParallelContext(), seed=5, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ParallelContext())
    opt.start_step(microbatches)
    depth = cfg.model.mtp_num_layers
    for t in _batches(microbatches):
        batch = {"tokens": t[:, :-1], "labels": t[:, 1:]}
        mtp = targets(batch, depth) if depth else None
        (model(**batch, mtp=mtp).mean() / microbatches).backward()
    pending = [b.pending for b in opt.buffer.buckets]  # the arrivals each bucket still waits for after backward
    opt.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}, model, pending


def _assert_same(fused: dict, unfused: dict) -> None:
    assert fused.keys() == unfused.keys()
    for name, want in unfused.items():
        torch.testing.assert_close(fused[name], want, rtol=1e-6, atol=1e-9, msg=name)


def _linear_weights(model) -> int:
    """How many weights go through the parallel linears: theirs and the output layer's (not the experts' grouped
    GEMMs, nor the router's)."""
    from engine.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    kinds = (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear)
    return sum(isinstance(m, kinds) for m in model.modules()) + 1


@pytest.mark.parametrize("family", ["gpt", "llama", "llama-recompute", "deepseek"])
def test_a_fused_step_gives_the_unfused_gradients(fused_on_cpu, family):
    cfg = _config(family)
    unfused, _, pending = _step(cfg, fuse=False)
    assert not fused_on_cpu
    fused, model, pending_fused = _step(cfg, fuse=True)
    _assert_same(fused, unfused)
    assert all(p.grad is None for p in model.parameters())
    assert pending_fused == pending  # every fused gradient was counted as it arrived
    mtp = cfg.model.mtp_num_layers or 0  # the output layer runs once more for each MTP module
    assert len(fused_on_cpu) == 2 * (_linear_weights(model) + mtp)


def test_no_fusion_flag_and_the_banner_line():
    from engine.cli import parse_config
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
    assert parse_config(base).training.gradient_accumulation_fusion is True  # Megatron-LM's default
    assert parse_config(base + ["--no-gradient-accumulation-fusion"]).training.gradient_accumulation_fusion is False
    assert grad_accumulation.describe(False, torch.device("cuda"), torch.bfloat16) == \
        "off (--no-gradient-accumulation-fusion)"
    assert grad_accumulation.describe(True, torch.device("cpu"), torch.float32).startswith("off on cpu")
    assert not grad_accumulation.supported(torch.device("cpu"), torch.float32)


def test_without_the_flag_nothing_is_fused_and_a_later_buffer_takes_the_sinks_away(fused_on_cpu):
    cfg = _config("llama")
    _, model, _ = _step(cfg, fuse=False)
    assert not fused_on_cpu and all(getattr(p, "grad_sink", None) is None for p in model.parameters())
    GradBuffer([model], ParallelContext(), distributed=False, overlap=False, fuse=True)
    assert all(p.grad_sink is not None for p in model.parameters())
    GradBuffer([model], ParallelContext(), distributed=False, overlap=False, fuse=False)
    assert all(p.grad_sink is None for p in model.parameters())


def _buffer_grads(model, buffer, microbatches=2, split=False) -> dict:
    buffer.start_step(microbatches)
    for t in _batches(microbatches):
        loss = model(tokens=t[:, :-1], labels=t[:, 1:]).mean() / microbatches
        if split:  # B then W, as a zero-bubble schedule runs them
            store = []
            with weight_grad_store.deferring_weight_grads(store):
                loss = model(tokens=t[:, :-1], labels=t[:, 1:]).mean() / microbatches
                loss.backward()
            weight_grad_store.weight_grads(store)
        else:
            loss.backward()
    pending = [(b.pending, b.rounds) for b in buffer.buckets]  # what backward's arrivals left to come
    buffer.finish()
    return {n: buffer.local_grad(p).clone() for n, p in model.named_parameters()}, pending


@pytest.mark.parametrize("mode", ["zero2", "split"])
def test_zero2_staging_and_a_split_backwards_w_pass_fuse_too(fused_on_cpu, mode):
    """ZeRO-2 sums each round's gradients in a staging tensor the fused products write into; a split backward's W
    pass adds the deferred weight gradients itself and counts them (no accumulate node runs there)."""
    cfg = _config("llama")
    kw = dict(distributed=True, shard_grads=True) if mode == "zero2" else dict(distributed=False)
    got, pending = {}, {}
    for fuse in (False, True):
        model = GPTModel(cfg.model, ParallelContext(), seed=5, vocab_size=VOCAB)
        buffer = GradBuffer([model], ParallelContext(), overlap=True, fuse=fuse, **kw)
        got[fuse], pending[fuse] = _buffer_grads(model, buffer, split=mode == "split")
    _assert_same(got[True], got[False])
    assert pending[True] == pending[False]  # each fused gradient counted as it arrived
    assert fused_on_cpu


def test_autograd_grad_needs_unfused_and_a_gradient_outside_a_step_is_refused(fused_on_cpu):
    cfg = _config("llama")
    model = GPTModel(cfg.model, ParallelContext(), seed=5, vocab_size=VOCAB)
    buffer = GradBuffer([model], ParallelContext(), distributed=False, overlap=False, fuse=True)
    t = _batches(1)[0]
    weights = [p for n, p in model.named_parameters() if p.dim() >= 2]
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.autograd.grad(model(tokens=t[:, :-1], labels=t[:, 1:]).mean(), weights, allow_unused=True)
    with grad_accumulation.unfused():
        grads = torch.autograd.grad(model(tokens=t[:, :-1], labels=t[:, 1:]).mean(), weights)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not buffer.data.any()  # nothing went into the buffer
    del buffer  # a buffer gone: the linears hand their gradients to autograd again
    loss = model(tokens=t[:, :-1], labels=t[:, 1:]).mean()
    loss.backward()
    assert all(p.grad is not None for p in weights)


def test_a_compiled_layer_takes_autograds_products(fused_on_cpu):
    """Inside a compiled region the fusion is off (its backward is traced, the addition into the buffer is a side
    effect): the layer's products are autograd's, the rest of the model's fused, the gradients the same."""
    cfg = _config("llama")
    unfused, _, _ = _step(cfg, fuse=False)
    fused_on_cpu.clear()
    cfg.training.gradient_accumulation_fusion = True
    model = GPTModel(cfg.model, ParallelContext(), seed=5, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ParallelContext())
    torch._dynamo.reset()
    for layer in model.layers.values():
        layer.compile(backend="aot_eager")
    opt.start_step(2)
    for t in _batches(2):
        (model(tokens=t[:, :-1], labels=t[:, 1:]).mean() / 2).backward()
    opt.finish_grad_sync()
    torch._dynamo.reset()
    _assert_same({n: p.main_grad for n, p in model.named_parameters()}, unfused)
    assert len(fused_on_cpu) == 2  # the output layer's, in each microbatch


def _sp_ranks(rank, world):
    with fusing_on_cpu():
        return _sp_steps(rank, world)


def _sp_steps(rank, world):
    from engine.config import Config
    from engine.optim import build_optimizer
    from engine.parallel.topology import build_context
    from engine.pipeline.partition import build_model_chunks
    out = {}
    for fuse in (False, True):
        cfg = Config()
        cfg.model = _config("llama").model
        cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = 2, True
        cfg.training.gradient_accumulation_fusion = fuse
        ctx = build_context(world, rank, 2, 1, sequence_parallel=True, seed=5)
        (model,) = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
        opt = build_optimizer(cfg, [model], ctx)
        opt.start_step(2)
        for t in _batches(2):
            (model(tokens=t[:, :-1], labels=t[:, 1:]).mean() / 2).backward()
        opt.finish_grad_sync()
        out[fuse] = {n: full_grad(p, ctx).clone() for n, p in model.named_parameters()}
        ctx.destroy()
    return out


def _cpu_fuses(rank, world):
    import torch

    from engine.parallel import grad_accumulation
    return grad_accumulation.supported(torch.device("cpu"), torch.float32)


def test_sequence_parallel_gathering_linears_fuse_on_two_ranks():
    for out in run_ranks(_sp_ranks, 2):
        _assert_same(out[True], out[False])
    assert run_ranks(_cpu_fuses, 2) == [False, False]  # the shared rank pool's later tests run as a real CPU run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU in this session")
def test_cuda_adds_bf16_products_into_fp32():
    """The probe passes on this torch, and the fused product equals the fp32 product of the bf16 values (exact
    in fp32) added to the target, to fp32 summation order; the unfused path's bf16 rounding is larger."""
    assert grad_accumulation.probe(torch.bfloat16) is None, grad_accumulation.probe(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    dy = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    start = torch.randn(768, 512, device="cuda", generator=g)
    want = start.double() + dy.double().t() @ x.double()
    fused = start.clone()
    grad_accumulation.accumulate(fused, x, dy)
    unfused = start + (dy.t() @ x).float()
    err = lambda t: float((t.double() - want).abs().max() / want.abs().max())  # noqa: E731
    assert err(fused) < 1e-5 and err(fused) < err(unfused)


def _zero3_ranks(rank, world):
    from test_sharded_dp import _cfg, _train
    with fusing_on_cpu() as calls:
        curves = {}
        for fuse in (False, True):
            cfg = _cfg("optim_grads_params", overlap=True)
            cfg.training.train_iters, cfg.training.gradient_accumulation_fusion = 4, fuse
            curves[fuse] = _train(rank, world, cfg, steps=range(4))
            curves[fuse, "fused products"] = len(calls)
        return curves


def test_zero3_gathered_weights_fuse_into_their_staged_rounds():
    """ZeRO-3 on two ranks (weights gathered per unit, gradients staged per round and reduce-scattered, both
    overlapped): the fused run's losses and gradient norms are the unfused run's."""
    for curves in run_ranks(_zero3_ranks, 2):
        assert curves[False, "fused products"] == 0 and curves[True, "fused products"] > 0
        for (loss, norm, updated, _), (want_loss, want_norm, want_updated, _) in zip(curves[True], curves[False]):
            assert updated == want_updated and loss == pytest.approx(want_loss, rel=1e-6)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def test_gpu_checks_gradient_comparison_asks_for_unfused_gradients(fused_on_cpu):
    """benchmarks/gpu/grad_check.py compares a loop's compiled gradients with its eager ones through
    torch.autograd.grad: with the engine's buffer fusing, its eager side still gets every weight's gradient, and the
    buffer is left as it was."""
    import types

    from benchmarks.gpu import grad_check
    cfg = _config("llama")
    model = GPTModel(cfg.model, ParallelContext(), seed=5, vocab_size=VOCAB)
    buffer = GradBuffer([model], ParallelContext(), distributed=False, overlap=False, fuse=True)
    t = _batches(1)[0]
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:]}
    loop = types.SimpleNamespace(model=model, autocast=None,
                                 loss=lambda b: model(tokens=b["tokens"], labels=b["labels"]).mean())
    grads = grad_check.gradients(loop, batch)
    assert all(g is not None for g in grads) and not fused_on_cpu and not buffer.data.any()


def test_the_probe_sums_right_and_says_why_not(monkeypatch):
    """The check `supported` runs once on CUDA: the right sum passes; an operator this torch lacks (bf16 products
    into fp32 on the CPU build) or a wrong sum is a reason, not a fused run."""
    assert grad_accumulation.sum_check("cpu", torch.float32) is None
    assert "cannot add torch.bfloat16 products into fp32" in grad_accumulation.sum_check("cpu", torch.bfloat16)
    monkeypatch.setattr(grad_accumulation, "accumulate", lambda target, x, dy: target.copy_(dy.t() @ x))
    assert "gave [3.0, 3.0, 3.0, 3.0] for 3.5" in grad_accumulation.sum_check("cpu", torch.float32)


def test_gpu_checks_training_section_checks_the_fused_gradients_first_and_falls_back(fused_on_cpu, tmp_path):
    """Before its rounds, gpu-check's training section compares the engine's fused gradients on one microbatch with
    its unfused ones (a `fused_grads` row). A fused step that fails or differs leaves the rest of the model's rows
    unfused, with a note, instead of costing them."""
    import time
    import types

    from benchmarks.gpu import grad_check, models, training
    from benchmarks.gpu.context import Options, Record
    from benchmarks.gpu.loops import EngineLoop
    from benchmarks.train import engine_trainer, process_group
    from engine.data import make_batch
    from engine.parallel.grad_accumulation import fusing
    cfg = models.config("llama", "tiny", 2, 2, 4, bf16=False)
    with process_group(False):
        ctx, trainer = engine_trainer(cfg, "cpu")
        try:
            loop = EngineLoop(trainer)
            bench = types.SimpleNamespace(loops={"engine": loop}, family="llama", cuda=False,
                                          batch=lambda: make_batch(trainer.train_ds, [0, 1], device="cpu"))
            record = Record("training", str(tmp_path / "r.json"), Options("cpu", False, True, str(tmp_path),
                                                                         time.time()), time.time() + 60)
            with contextlib.ExitStack() as unfused:
                training.check_fusion(record, bench, unfused)
                (row,) = record.data["tables"]["fused_grads"]
                assert row["match"] and row["fused"] > 0 and row["worst_rel_diff"] <= 1e-5, row
                assert fusing(loop.model.layers["0"].mlp.fc1.weight) is not None and not record.data["notes"]
                trainer.iterate()  # the loop's next step starts afresh after the check's
            with contextlib.ExitStack() as unfused:  # a failing fused step: the rows run unfused, said in a note
                def broken(loop, batch):
                    raise RuntimeError("no such kernel")
                grad_check.fused_vs_unfused, original = broken, grad_check.fused_vs_unfused
                try:
                    training.check_fusion(record, bench, unfused)
                finally:
                    grad_check.fused_vs_unfused = original
                assert fusing(loop.model.layers["0"].mlp.fc1.weight) is None
                assert "run without gradient-accumulation fusion" in record.data["notes"][-1]
            assert fusing(loop.model.layers["0"].mlp.fc1.weight) is not None  # given back after the section
            with contextlib.ExitStack() as unfused:  # out of memory for the check: no finding, the rows stay fused
                def too_big(loop, batch):
                    raise torch.OutOfMemoryError("CUDA out of memory")
                grad_check.fused_vs_unfused, original = too_big, grad_check.fused_vs_unfused
                try:
                    training.check_fusion(record, bench, unfused)
                finally:
                    grad_check.fused_vs_unfused = original
                assert fusing(loop.model.layers["0"].mlp.fc1.weight) is not None
                assert record.data["tables"]["fused_grads"][-1]["match"] is None
        finally:
            from benchmarks.gpu.bench import finish
            finish(ctx, trainer)

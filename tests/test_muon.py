"""Issue 36, one rank: Ternion's Muon is torch.optim.Muon's algorithm.

torch.optim.Muon always casts its Newton-Schulz iteration to bf16; the oracle here is torch's own optimizer
(momentum, Nesterov, weight decay, adjust_lr) with `_zeropower_via_newtonschulz` replaced by the same
function with that cast lifted (fp32) and, for Megatron's "quintic", fed the schedule of coefficients; the
replacement is first shown to be torch's function (bitwise, with the cast put back). Ternion runs the same
tiny Llama (GQA, SwiGLU, RMSNorm, RoPE, untied) 20 steps with --muon-fp32-matmul-prec high: losses within
1e-5 relative, every matrix's learned change within 2e-3, the scalar parameters AdamW's. Beside it: the
matrices a weight is made of (QKV split as Megatron-Core splits it), the flags' one-line mistakes, the
checkpoint's optimizer type checked on load, the start-up listing.
"""
import pytest
import torch
import torch.optim._muon as torch_muon
from torch.nn.utils import parametrize

from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.saver import save_checkpoint
from engine.config import Config, ConfigError, ModelConfig
from engine.layout import Layout
from engine.model import GPTModel
from engine.optim import build_optimizer, lr_at
from engine.optim.muon import classify, summary
from engine.optim.newton_schulz import COEFFICIENTS, MuonSettings, blocks, newton_schulz, orthogonalize
from engine.parallel.layers import ParamSpec
from engine.parallel.topology import ParallelContext
from engine.validation import validate
from harness import NO_DROPOUT

VOCAB, SEQ, STEPS, MICRO = 96, 16, 20, 2


def _cfg(**optim):
    cfg = Config()
    cfg.model = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
                            vocab_size=VOCAB, make_vocab_size_divisible_by=16, swiglu=True, normalization="RMSNorm",
                            position_embedding_type="rope", disable_bias_linear=True,
                            untie_embeddings_and_output_weights=True)
    cfg.training.seed = 3
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_iters = 2e-2, 2e-3, 2
    cfg.optim.weight_decay, cfg.optim.clip_grad = 0.1, 1.0
    cfg.optim.optimizer, cfg.optim.muon_fp32_matmul_prec = "muon", "high"
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return cfg


def _batches(step):
    out = []
    for i in range(MICRO):
        g = torch.Generator().manual_seed(7919 * ((step * MICRO + i) % 6))
        t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _torch_ns(schedule, bf16=False):
    """torch.optim._muon._zeropower_via_newtonschulz, its coefficients per step from `schedule` and its bf16
    cast optional (written out line by line from torch 2.13's source)."""
    def ns(grad, ns_coefficients, ns_steps, eps):
        x = grad.bfloat16() if bf16 else grad.to(torch.float32, copy=True)  # a copy either way: x.div_ below
        if grad.size(0) > grad.size(1):
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for step in range(ns_steps):
            a, b, c = schedule[step] if schedule is not None else ns_coefficients
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x
    return ns


def test_the_oracle_is_torchs_newton_schulz_with_the_cast_lifted():
    g = torch.Generator().manual_seed(0)
    for shape in ((24, 16), (16, 40)):
        m = torch.randn(shape, generator=g)
        theirs = torch_muon._zeropower_via_newtonschulz(m, COEFFICIENTS["simple"][0], 5, 1e-7)
        assert torch.equal(_torch_ns(None, bf16=True)(m, COEFFICIENTS["simple"][0], 5, 1e-7), theirs)
        ours = newton_schulz(m, COEFFICIENTS["simple"] * 5, bf16=False)
        torch.testing.assert_close(ours, _torch_ns(None)(m, COEFFICIENTS["simple"][0], 5, 1e-7), rtol=0, atol=1e-6)
        quintic = newton_schulz(m, COEFFICIENTS["quintic"], bf16=False)
        torch.testing.assert_close(quintic, _torch_ns(COEFFICIENTS["quintic"])(m, None, 5, 1e-7), rtol=0, atol=1e-6)


class _Stacked(torch.nn.Module):
    """SwiGLU's [2, F, h] weight stored as the [2F, h] matrix torch.optim.Muon takes (it refuses 3-D)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.view(self.shape)

    def right_inverse(self, w):
        return w.reshape(-1, w.shape[-1])


def _reference(cfg, adjust):
    """The model and torch's optimizers: Muon (2-D hidden matrices, fc1 stored [2F, h]), AdamW the rest."""
    model = GPTModel(cfg.model, ParallelContext(), seed=cfg.training.seed, vocab_size=VOCAB)
    for layer in model.layers.values():
        parametrize.register_parametrization(layer.mlp.fc1, "weight", _Stacked(tuple(layer.mlp.fc1.weight.shape)))
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.endswith(("qkv.weight", "proj.weight", "fc2.weight", "original"))]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    o = cfg.optim
    muon = torch.optim.Muon(hidden, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_num_ns_steps, adjust_lr_fn=adjust)
    adam = torch.optim.AdamW([dict(params=[p for p in rest if p.ndim >= 2], weight_decay=o.weight_decay),
                              dict(params=[p for p in rest if p.ndim < 2], weight_decay=0.0)],
                             lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True)
    return model, [muon, adam]


def _train(model, step_fn, steps=STEPS):
    losses = []
    for step in range(steps):
        batches, total = _batches(step), 0.0
        for tokens, labels in batches:
            loss = model(tokens, labels=labels).mean()
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        losses.append(total)
        step_fn(step)
    return losses


def _torch_run(cfg, adjust):
    model, opts = _reference(cfg, adjust)
    params = list(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step(i):
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad)
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr_at(i, cfg.optim, STEPS)
            opt.step()
            opt.zero_grad()
    losses = _train(model, step)
    with torch.no_grad():
        after = {n.replace(".parametrizations.weight.original", ".weight"): p.detach().clone()
                 for n, p in model.named_parameters()}
    before = {n.replace(".parametrizations.weight.original", ".weight"): p for n, p in before.items()}
    return losses, before, after


def _ternion_run(cfg):
    ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, 1))
    model = GPTModel(cfg.model, ctx, seed=cfg.training.seed, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ctx)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step(i):
        opt.finish_grad_sync()
        assert opt.step(lr_at(i, cfg.optim, STEPS)).updated
        opt.start_step(MICRO)
    opt.start_step(MICRO)
    losses = _train(model, step)
    return losses, before, {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [  # (Ternion's flags, torch's adjust_lr_fn, Newton-Schulz schedule fed to torch or None)
    (dict(muon_coefficient_type="simple", muon_scale_mode="shape_scaling", muon_nesterov=True), "original", None),
    (dict(muon_coefficient_type="simple", muon_scale_mode="spectral", muon_extra_scale_factor=0.2),
     "match_rms_adamw", None),
    (dict(muon_scale_mode="shape_scaling", muon_nesterov=True), "original", COEFFICIENTS["quintic"]),
]


@pytest.mark.parametrize("flags, adjust, schedule", CASES, ids=["simple-nesterov", "simple-rms", "quintic"])
def test_twenty_steps_equal_torch_muon_in_fp32(flags, adjust, schedule, monkeypatch):
    cfg = _cfg(muon_no_split_qkv=True, **flags)  # torch's Muon takes the fused QKV as one matrix
    ours, before, after = _ternion_run(cfg)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _torch_ns(schedule))
    theirs, ref_before, ref_after = _torch_run(cfg, adjust)
    assert ours[-1] < ours[0] - 0.5, ours  # it learns
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    params = dict(GPTModel(cfg.model, ParallelContext(), device="meta", vocab_size=VOCAB).named_parameters())
    for name, w in after.items():
        ref_start, ref_end = (t[name].view(w.shape) for t in (ref_before, ref_after))  # fc1 stored [2F, h] there
        torch.testing.assert_close(before[name], ref_start, rtol=0, atol=0)
        change, ref_change = w - before[name], ref_end - ref_start
        if classify(name, params[name]):
            torch.testing.assert_close(w, ref_end, rtol=1e-4, atol=1e-6)  # AdamW's own step
        else:
            assert (change - ref_change).norm() <= 2e-3 * ref_change.norm(), name


def test_qkv_splits_into_q_k_and_v_as_megatron_core_does_and_fc1_stays_one_matrix():
    """Megatron-Core views the fused QKV [g x (q, k, v), h] as [g, rows, h] and orthogonalises all q rows, all k
    rows and all v rows apart (each scaled by its own shape); SwiGLU's [gate; up] is one matrix."""
    d, per_group, groups, h = 4, 2, 3, 16
    spec = ParamSpec((groups * (per_group + 2) * d, h), 0, matrix="linear", row_blocks=(per_group * d, d, d))
    m = torch.randn(spec.full_shape, generator=torch.Generator().manual_seed(1))
    settings = MuonSettings(bf16=False)
    out = orthogonalize(m, spec, settings).view(groups, -1, h)
    q = per_group * d
    for lo, hi in ((0, q), (q, q + d), (q + d, q + 2 * d)):
        block = m.view(groups, -1, h)[:, lo:hi].reshape(-1, h)
        expected = newton_schulz(block, settings.coefficients, False) * max(block.shape) ** 0.5
        torch.testing.assert_close(out[:, lo:hi].reshape(-1, h), expected, rtol=0, atol=0)
    whole = orthogonalize(m, spec, MuonSettings(bf16=False, split_qkv=False))
    torch.testing.assert_close(whole, newton_schulz(m, settings.coefficients, False) * max(m.shape) ** 0.5)
    fc1 = ParamSpec((2, 8, h), 1, matrix="linear")
    w = torch.randn(fc1.full_shape)
    assert [tuple(b.shape) for b in blocks(w, fc1, True)] == [(16, h)]
    experts = ParamSpec((3, h, 8), None, matrix="experts")  # [E, in, out]: one [out, in] matrix per expert
    assert [tuple(b.shape) for b in blocks(torch.randn(3, h, 8), experts, True)] == [(8, h)] * 3


@pytest.mark.parametrize("flags, line", [
    (dict(muon_num_ns_steps=3), "--muon-num-ns-steps 3: must be a positive multiple of the 5 coefficient sets of "
                                "--muon-coefficient-type quintic"),
    (dict(muon_num_ns_steps=0, muon_coefficient_type="simple"), "--muon-num-ns-steps 0: must be a positive"),
    (dict(muon_momentum=1.0), "--muon-momentum 1.0: must be at least 0 and below 1"),
])
def test_muon_flag_mistakes_are_one_line(flags, line):
    cfg = _cfg(**flags)
    cfg.data.mock_data = True
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    assert str(info.value).startswith(line), str(info.value)


def test_every_parameter_is_taken_by_muon_or_listed_with_its_reason():
    model = GPTModel(_cfg().model, ParallelContext(), device="meta", vocab_size=VOCAB)
    named = [(n, p.shape, classify(n, p)) for n, p in model.named_parameters()]
    muon = sorted(n for n, _, why in named if not why)
    assert muon == sorted(f"layers.{i}.{w}.weight" for i in range(2) for w in ("attention.qkv", "attention.proj",
                                                                               "mlp.fc1", "mlp.fc2"))
    lines = summary(named, MuonSettings())
    assert lines[0].startswith("optimizer: muon on the 8 weights of the hidden layers (30,720 parameters; momentum "
                               "0.9, 5 Newton-Schulz steps (quintic, bf16)")
    assert lines[1] == "  a vocabulary table (embedding or output layer): output [96, 32], word.weight [96, 32]"
    assert lines[2] == "  1-D: layers.*.norm1.weight [32] x2, layers.*.norm2.weight [32] x2, final_norm.weight [32]"


def test_the_banner_and_the_log_line_name_the_optimizer():
    from engine.metrics import format_log_line
    from engine.report import optimizer_lines
    cfg = _cfg(muon_tp_mode="blockwise")
    ctx = ParallelContext.virtual(tp=2, sequence_parallel=True)
    chunks = [GPTModel(cfg.model, ctx, device="meta", vocab_size=VOCAB)]
    lines = optimizer_lines(cfg, ctx, chunks)
    assert lines[0].startswith("optimizer: muon on the 8 weights") and "output [96, 32]" in lines[1]
    assert lines[-1].startswith("  --muon-tp-mode blockwise: each of the 2 tp ranks orthogonalises its own shard")
    cfg.optim.muon_tp_mode = "duplicated"
    assert "blockwise" not in "\n".join(optimizer_lines(cfg, ctx, chunks))
    cfg.optim.optimizer = "adam"
    assert optimizer_lines(cfg, ctx, chunks) == ["optimizer: adam (AdamW: betas (0.9, 0.999), eps 1e-08, decoupled "
                                                 "weight decay 0.1 on the 2-D parameters)"]
    line = format_log_line({"iteration": 3, "lm_loss": 2.0, "lr": 1e-3, "optimizer": "muon"})
    assert "| optimizer: muon | learning rate: 1.000000E-03 |" in line
    assert "optimizer" not in format_log_line({"iteration": 3, "lm_loss": 2.0, "lr": 1e-3})


def _save_adam(tmp_path):
    cfg = _cfg(optimizer="adam")
    ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, 1))
    model = GPTModel(cfg.model, ctx, seed=cfg.training.seed, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ctx)
    save_checkpoint(str(tmp_path), 1, [model], opt, ctx, cfg, {})
    return ctx


def test_a_checkpoints_optimizer_type_is_checked_on_load(tmp_path):
    ctx = _save_adam(tmp_path)
    cfg = _cfg()
    model = GPTModel(cfg.model, ctx, seed=9, vocab_size=VOCAB)
    opt = build_optimizer(cfg, [model], ctx)
    with pytest.raises(ConfigError, match="holds adam optimizer state, and this run trains with --optimizer muon; "
                                          "load it with --no-load-optim"):
        load_checkpoint(str(tmp_path), [model], opt, ctx)
    assert load_checkpoint(str(tmp_path), [model], opt, ctx, load_optim=False)["iteration"] == 1


SMALL = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--swiglu", "--vocab-size", "300", "--seq-length", "32", "--mock-data", "--bf16", "--optimizer", "muon"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
@pytest.mark.parametrize("extra", [[], MOE], ids=["dense", "moe"])
def test_planner_state_bytes_equal_the_engines_under_muon(strategy, extra):
    """One fp32 momentum per element of the matrices Muon takes, Adam's two moments for the rest, fp32 masters:
    engine/planner/sharding.py's bytes of dp rank 0 equal Optimizer.memory_bytes() exactly, and the ZeRO
    formula (memory.state_bytes) stays within the shard padding."""
    from engine.cli import parse_config
    from engine.optim import adamw
    from engine.pipeline.partition import build_model_chunks
    from engine.planner.memory import state_bytes
    from engine.planner.params import param_split_per_rank
    from engine.planner.sharding import rank_state_bytes
    cfg = parse_config(SMALL + extra)
    layouts = [Layout(2, 2, 2, sequence_parallel=True, sharding_strategy=strategy),
               Layout(1, 1, 4, ep=2 if extra else 1, sharding_strategy=strategy)]
    for layout in layouts:
        for r in range(layout.pp):
            ctx = ParallelContext.virtual(layout=layout, pp_rank=r)
            cfg.parallel.data_parallel_sharding_strategy = layout.sharding_strategy
            chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="meta", dtype=torch.bfloat16)
            opt = build_optimizer(cfg, chunks, ctx, bucket_numel=5000)
            held = opt.memory_bytes()
            steps = sum(t.numel() * t.element_size() for t in adamw.state_tensors(opt.adam) if t.dim() == 0)
            frozen = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters() if not p.requires_grad)
            engine = (held["params"] + frozen, held["grads"], held["optimizer"] - steps)
            assert rank_state_bytes(cfg.model, layout, "bf16", r, 5000, optimizer="muon") == engine, (layout, r)
            dense, experts, _ = param_split_per_rank(cfg.model, layout)[r]
            muon = param_split_per_rank(cfg.model, layout, muon=True)[r][:2]
            formula = state_bytes(dense, layout, "bf16", experts, muon=muon)[2]
            assert abs(formula - engine[2]) <= 12 * 64 * layout.dp * 8, (layout, r, formula, engine[2])
            adam = state_bytes(dense, layout, "bf16", experts)[2]
            assert formula < adam  # Muon's state is smaller than Adam's


@pytest.mark.parametrize("layout, mode", [
    (Layout(2, 1, 2, sequence_parallel=True, sharding_strategy="optim"), "duplicated"),
    (Layout(2, 1, 2, sequence_parallel=True, sharding_strategy="optim_grads_params"), "distributed"),
    (Layout(2, 1, 2, sequence_parallel=True), "blockwise"),
    (Layout(1, 2, 4, sharding_strategy="optim"), "duplicated"),
    (Layout(1, 1, 4, ep=2, sharding_strategy="optim"), "duplicated"),
], ids=["tp2-dp2-zero1-duplicated", "tp2-dp2-zero3-distributed", "tp2-dp2-blockwise", "pp2-dp4-zero1", "ep2-dp4"])
def test_planner_prices_the_newton_schulz_work_and_bytes_the_engine_plans(layout, mode):
    """engine/planner/muon_step.py against the engine's plans on every rank of pipeline rank 0: the FLOPs are the
    ranks' mean exactly (each matrix orthogonalised by one owner, or by every tp rank under duplicated), the bytes
    their mean within 10% (buckets of 3000 elements cut the weights into parts of similar size; the experts, one
    matrix per expert, lie within one replica's slice each: the engine moves fewer bytes than the estimate)."""
    from engine.cli import parse_config
    from engine.pipeline.partition import build_model_chunks
    from engine.planner.muon_step import muon_cost
    extra = MOE if layout.ep > 1 else []
    cfg = parse_config(SMALL + extra + ["--muon-tp-mode", mode])
    cfg.parallel.data_parallel_sharding_strategy = layout.sharding_strategy
    flops, sent = [], []
    for t in range(layout.tp):
        for d in range(layout.dp):
            ctx = ParallelContext.virtual(layout=layout, tp_rank=t, dp_rank=d)
            chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="meta", dtype=torch.bfloat16)
            muon = build_optimizer(cfg, chunks, ctx, bucket_numel=3000).muon
            flops.append(muon.flops())
            sent.append(muon.bytes_sent())
    cost = muon_cost(cfg.model, layout, 0, MuonSettings.of(cfg.optim))
    assert cost.flops == pytest.approx(sum(flops) / len(flops), rel=1e-12), (cost, flops)
    planned, mean = cost.dp_bytes + cost.tp_bytes, sum(sent) / len(sent)
    assert abs(planned - mean) <= 0.1 * planned and mean <= planned + cost.edp_bytes, (cost, sent)


def test_post_validation_undoes_and_redoes_a_muon_step_exactly():
    """Zero-bubble schedules step before the gradient norm is known (engine/optim/post_validation.py): a Muon
    step that clipping should have scaled is undone from the copies (momentum among them) and redone; the
    weights and momenta then equal the synchronous path's, step after step."""
    from engine.optim.post_validation import PostValidator
    cfg = _cfg(clip_grad=0.3)
    ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, 1))
    models = [GPTModel(cfg.model, ctx, seed=cfg.training.seed, vocab_size=VOCAB) for _ in range(2)]
    opts = [build_optimizer(cfg, [m], ctx) for m in models]
    validator, redone = PostValidator(opts[1], ctx), 0
    for step in range(4):
        for model, opt in zip(models, opts):
            opt.start_step(1)
            tokens, labels = _batches(step)[0]
            model(tokens, labels=labels).mean().backward()
            opt.finish_grad_sync()
        lr = lr_at(step + 2, cfg.optim, STEPS)
        synchronous = opts[0].step(lr)
        validator.speculate(lr, [1.0])
        settled = validator.settle()
        redone += settled.rerun
        assert settled.result.grad_norm == pytest.approx(synchronous.grad_norm, rel=1e-6)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(opts[0].muon.momenta, opts[1].muon.momenta):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert redone >= 2, redone  # clipping hit, so steps were undone and redone


def test_bf16_weights_train_from_fp32_masters_and_momenta():
    """Mixed precision: Muon updates the fp32 masters (its momentum fp32 too) and the bf16 weights are their
    rounding, as under AdamW."""
    cfg = _cfg(muon_fp32_matmul_prec="medium")
    ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, 1))
    model = GPTModel(cfg.model, ctx, seed=cfg.training.seed, vocab_size=VOCAB, dtype=torch.bfloat16)
    opt = build_optimizer(cfg, [model], ctx)
    losses = []
    for step in range(8):
        opt.start_step(MICRO)
        for tokens, labels in _batches(step):
            loss = model(tokens, labels=labels).float().mean()
            (loss / MICRO).backward()
            losses.append(loss.item())
        opt.finish_grad_sync()
        assert opt.step(lr_at(step + 2, cfg.optim, STEPS)).updated
    assert sum(losses[-4:]) < sum(losses[:4]) - 1.0, losses
    state = opt.state_dict()["params"]["layers.0.mlp.fc1.weight"]
    assert state["momentum"].dtype == torch.float32 and state["master"].dtype == torch.float32
    w = dict(model.named_parameters())["layers.0.mlp.fc1.weight"]
    torch.testing.assert_close(w.detach().reshape(-1), state["master"].to(torch.bfloat16), rtol=0, atol=0)

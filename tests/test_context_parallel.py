"""Context parallelism against one rank (fp32, CPU, gloo): the chunk layout, the ring's static plan, ring and
all-gather attention, and whole models over tp x cp x pp x dp layouts of up to 8 ranks."""
import functools
import math

import pytest
import torch

from engine.attention_mask import AttentionMask
from engine.config import Config, ConfigError, ModelConfig
from engine.model import TIED_EMBEDDING, GPTModel
from engine.parallel import context_split, ring_attention
from engine.parallel.ring_attention import ContextAttention, blocks_between, ring_order
from engine.parallel.topology import ParallelContext, build_context, grid_coords, rank_grid
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.validation import validate
from harness import NO_DROPOUT, SGD_LR, full_grad, grad_buffer, run_ranks, sgd_reference
from kernels import reference

VOCAB, SEQ, MICRO = 64, 16, 2


# ---------------------------------------------------------------- layout and plan (no process group)

def test_rank_order_is_tp_cp_dp_pp():
    g = rank_grid(16, 2, 2, cp=2)  # dp 2
    assert g["tp"][:2] == [[0, 1], [2, 3]]
    assert g["cp"][:2] == [[0, 2], [1, 3]]
    assert g["dp"][:2] == [[0, 4], [1, 5]]
    assert g["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["pp"][0] == [0, 8]
    for r in range(16):
        t, c, d, p = grid_coords(r, 2, 2, 2)
        assert r == t + 2 * (c + 2 * (d + 2 * p))
        dp_cp = next(grp for grp in g["dp_cp"] if r in grp)
        assert dp_cp.index(r) == ParallelContext.virtual(tp=2, pp=2, dp=2, cp=2, tp_rank=t, cp_rank=c, dp_rank=d,
                                                         pp_rank=p).dp_cp_rank


def test_load_balanced_chunks_cover_the_sequence_once():
    for cp in (1, 2, 4):
        held = torch.cat([context_split.positions(24, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))
    assert context_split.positions(16, 4, 1).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    t = torch.arange(2 * 16).view(2, 16)
    assert context_split.split(t, 1, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_plan_computes_every_causal_block_once_with_equal_work(cp):
    seen, work, c = {}, [], 4
    for r in range(cp):
        assert ring_order(cp, r)[0] == r and sorted(ring_order(cp, r)) == list(range(cp))
        assert [owner for _, owner, _ in ring_attention.plan(cp, r, c, AttentionMask())] == ring_order(cp, r)
        cost = 0
        for step, owner in enumerate(ring_order(cp, r)):
            blocks = blocks_between(cp, r, owner, c, AttentionMask())
            for b in blocks:
                pair = (context_split.chunk_ids(cp, r)[b.q], context_split.chunk_ids(cp, owner)[b.k])
                assert pair not in seen and (b.queries[0], b.keys[0]) == (pair[0] * c, pair[1] * c)
                seen[pair] = b.pairs == c * (c + 1) // 2  # the diagonal: its lower triangle
                assert b.pairs == c * c or seen[pair]
                cost += b.pairs
            # every step alike: two diagonals and a full block at step 0, two full blocks after
            assert sum(b.pairs for b in blocks) == (2 * c * c if step else c * (c + 1) + c * c), (cp, r, step)
        work.append(cost)
    want = {(q, k): q == k for q in range(2 * cp) for k in range(q + 1)}
    assert seen == want
    assert max(work) == min(work)


def _cfg(**par) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
    cfg.data.mock_data = True
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("par,world,flag", [
    ({"context_parallel_size": 3}, 3, "--seq-length"),  # 16 is not divisible by 6
    ({"context_parallel_size": 2, "tensor_model_parallel_size": 4, "sequence_parallel": True}, 8, "--seq-length"),
    ({"context_parallel_size": 2}, 3, "--context-parallel-size"),
    ({"context_parallel_size": 0}, 1, "--context-parallel-size"),
])
def test_bad_context_split_is_one_clear_line(par, world, flag):
    cfg = _cfg(**par)
    if par.get("tensor_model_parallel_size") == 4:
        cfg.model.seq_length = 12  # divisible by 2 x cp = 4 but not by tp x cp = 8
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_flash_backend_refused_under_cp_and_megatron_spelling_accepted():
    cfg = _cfg(context_parallel_size=2)
    cfg.model.attention_backend = "flash"
    with pytest.raises(ConfigError, match="--attention-backend"):
        validate(cfg, 2)
    cfg = _cfg(context_parallel_size=2, cp_comm_type="allgather")
    validate(cfg, 4)
    assert cfg.parallel.cp_comm_type == "all_gather" and cfg.dp(4) == 2


def test_block_kernels_backward_matches_autograd_with_dropout():
    """The written-out block backward (used by the ring) against autograd of the block forward, float64."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    for causal in (True, False):
        for p in (0.0, 0.3):
            out, lse = reference.attention_block_forward(q, k, v, causal, None, p, 77)
            do = torch.randn(out.shape, generator=g, dtype=torch.float64)
            want = torch.autograd.grad(out, (q, k, v), do)
            got = reference.attention_block_backward(do, q.detach(), k.detach(), v.detach(), out.detach(),
                                                     lse.detach(), causal, None, p, 77)
            for a, b in zip(got, want):
                assert torch.allclose(a, b, atol=1e-12), (causal, p)


# ---------------------------------------------------------------- attention over the CP group

def _qkv(seed, b=2, s=SEQ, nq=4, nkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g) for n in (nq, nkv, nkv)]


def _attention_case(rank, world, cp, comm_type, nkv):
    ctx = build_context(world, rank, 1, 1, cp=cp, cp_comm_type=comm_type)
    full = [t.requires_grad_() for t in _qkv(5, nkv=nkv)]
    ref = reference.attention(*full, causal=True)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    ref.backward(dout)
    cut = lambda t: context_split.split(t, 1, ctx.cp_size, ctx.cp_rank)  # noqa: E731
    local = [cut(t.detach()).requires_grad_() for t in full]
    attn = ContextAttention(ctx, "reference")
    with ring_attention.counting() as flops:
        out = attn(*local, AttentionMask())
        out.backward(cut(dout))
    failures = []
    for name, got, want in (("out", out, ref), ("dq", local[0].grad, full[0].grad), ("dk", local[1].grad, full[1].grad),
                            ("dv", local[2].grad, full[2].grad)):
        err = (got - cut(want.detach() if name == "out" else want)).abs().max().item()
        if err > 1e-5:
            failures.append(f"cp {cp} {comm_type} nkv {nkv}: {name} err {err:.3g}")
    with ctx.rng.fork():  # dropout: the same stream on both comm types -> the same masks
        dropped = attn(*[t.detach() for t in local], AttentionMask(), dropout_p=0.2)
    ctx.destroy()
    return failures, flops.forward, flops.backward, dropped


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_all_gather_attention_equal_one_rank_with_balanced_flops(cp):
    results = {}
    for comm_type in ("p2p", "all_gather"):
        for nkv in (2, 4):  # grouped-query and multi-head
            results[comm_type, nkv] = run_ranks(_attention_case, 4, cp, comm_type, nkv, timeout=120)
    problems = [f for res in results.values() for r in res for f in r[0]]
    assert not problems, "\n".join(problems)
    for res in results.values():
        fwd, bwd = [r[1] for r in res], [r[2] for r in res]
        assert max(fwd) <= 1.05 * min(fwd) and max(bwd) <= 1.05 * min(bwd), (fwd, bwd)
        # together a CP group does exactly the causal work of one rank: s(s+1)/2 query-key pairs
        b, s, nq, d = 2, SEQ, 4, 8
        one_rank = 4.0 * b * nq * d * s * (s + 1) / 2
        assert math.isclose(sum(fwd) * cp / len(fwd), one_rank, rel_tol=1e-9), (sum(fwd), one_rank)
    for nkv in (2, 4):
        for a, b in zip(results["p2p", nkv], results["all_gather", nkv]):
            assert torch.equal(a[3], b[3])  # dropout masks drawn per block, identically for both kinds
            assert not torch.isnan(a[3]).any()


# ---------------------------------------------------------------- whole models over layouts of 8 ranks

def model_cfg(style: str) -> ModelConfig:
    common = dict(num_layers=4, hidden_size=32, seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=16)
    if style == "gpt2":  # learned positions, multi-head attention, LayerNorm, tied embeddings
        return ModelConfig(**NO_DROPOUT, num_attention_heads=4, **common)
    return ModelConfig(**NO_DROPOUT, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",  # rope, GQA
                       position_embedding_type="rope", swiglu=True, disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True, **common)


def global_batch(step: int, n: int, micro: int = MICRO):
    """`n` samples in microbatches of `micro` (each microbatch's loss is its own masked mean)."""
    g = torch.Generator().manual_seed(2000 + step % 3)  # three batches, revisited: the loss falls
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    mask = (torch.rand(n, SEQ, generator=g) > 0.2).float()  # some tokens carry no loss
    return [{"tokens": t[i:i + micro, :-1], "labels": t[i:i + micro, 1:], "loss_mask": mask[i:i + micro]}
            for i in range(0, n, micro)]


def _model_layout(rank, world, style, tp, cp, pp, vpp, comm_type, recompute, steps, microbatches, micro=MICRO):
    """This layout's loss curve and step-0 gradients (whole tensors, by name) on this rank."""
    cfg = Config()
    cfg.model = model_cfg(style)
    cfg.model.recompute_granularity = recompute
    par = cfg.parallel
    par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size = tp, pp, cp
    par.virtual_pipeline_model_parallel_size, par.sequence_parallel = vpp, tp > 1
    cfg.training.seed = 9
    ctx = build_context(world, rank, tp, pp, vpp=vpp, sequence_parallel=tp > 1, seed=9, cp=cp, cp_comm_type=comm_type)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, micro, 32), torch.float32, "cpu")
    params = [p for c in chunks for p in c.parameters()]
    grads, curve, first_grads = grad_buffer(chunks, ctx, microbatches), [], {}
    for step in range(steps):
        mbs = global_batch(step, microbatches * micro * ctx.dp_size, micro)
        grads.start_step(microbatches)
        curve.append(runner.run(mbs[ctx.dp_rank * microbatches:(ctx.dp_rank + 1) * microbatches]))
        grads.finish()
        if step == 0:
            first_grads = {n: full_grad(p, ctx).clone() for c in chunks for n, p in c.named_parameters()}
        with torch.no_grad():
            for p in params:
                p -= SGD_LR * p.main_grad  # plain SGD, as on the reference
    ctx.destroy()
    return curve, first_grads


@functools.lru_cache(maxsize=None)
def reference_run(style: str, samples: int, steps: int, micro: int = MICRO) -> tuple:
    """The same training on one rank, in this process (once per batch shape): curve and step-0 grads."""
    model = GPTModel(model_cfg(style), ParallelContext(), seed=9, vocab_size=VOCAB)
    return sgd_reference(model, lambda step: global_batch(step, samples, micro), steps)


def compare_with_reference(results: list, ref_curve: list, ref_grads: dict, tied: bool) -> list:
    """Loss and every gradient at step 0 within 1e-5, the whole curve within 1e-4, on every rank."""
    failures = []
    for rank, (curve, grads) in enumerate(results):
        if abs(curve[0] - ref_curve[0]) > 1e-5:
            failures.append(f"rank {rank}: loss {curve[0]} vs {ref_curve[0]}")
        diff = max(abs(a - b) for a, b in zip(curve, ref_curve))
        if diff > 1e-4:
            failures.append(f"rank {rank}: {len(curve)}-step curve differs by {diff}")
        for name, got in grads.items():
            want = ref_grads[TIED_EMBEDDING if name == "output" and tied else name]
            err = (got - want).abs().max().item()
            if err > 1e-5 * want.abs().max().item() + 1e-8:
                failures.append(f"rank {rank}: grad {name} err {err:.3g}")
    if not ref_curve[-1] < ref_curve[0]:
        failures.append(f"the loss did not fall: {ref_curve}")
    return failures


CP_LAYOUTS = [  # (style, tp, cp, pp, vpp, comm type, recomputation): 8 ranks, dp = 8 / (tp cp pp)
    ("llama", 1, 2, 1, 1, "p2p", None),              # dp 4
    ("gpt2", 1, 4, 1, 1, "all_gather", "full"),      # dp 2
    ("llama", 2, 2, 1, 1, "all_gather", None),       # tp 2 + SP, dp 2
    ("gpt2", 2, 2, 2, 1, "p2p", "selective"),        # tp 2 + SP, pp 2
    ("llama", 1, 2, 2, 2, "p2p", None),              # pp 2 interleaved, dp 2
    ("llama", 2, 4, 1, 1, "p2p", "selective"),       # tp 2 + SP, cp 4
    ("gpt2", 1, 4, 2, 1, "all_gather", None),        # cp 4, pp 2
]


@pytest.mark.slow
@pytest.mark.parametrize("style,tp,cp,pp,vpp,comm_type,recompute", CP_LAYOUTS,
                         ids=[f"{s}-tp{t}-cp{c}-pp{p}{f'-vpp{v}' if v > 1 else ''}-{k}{f'-{r}' if r else ''}"
                              for s, t, c, p, v, k, r in CP_LAYOUTS])
def test_cp_layouts_equal_one_rank_loss_gradients_and_20_step_curve(style, tp, cp, pp, vpp, comm_type, recompute):
    # a rank's 2 x MICRO samples in as few microbatches as its pipeline takes (pp): each collective costs
    # milliseconds on 8 processes sharing two cores; the reference groups the samples the same way
    microbatches = pp
    micro = 2 * MICRO // microbatches
    results = run_ranks(_model_layout, 8, style, tp, cp, pp, vpp, comm_type, recompute, 20, microbatches, micro,
                        timeout=300)
    dp = 8 // (tp * cp * pp)
    ref_curve, ref_grads = reference_run(style, 2 * MICRO * dp, 20, micro)
    problems = compare_with_reference(results, ref_curve, ref_grads, tied=style == "gpt2")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- dropout under CP

def _dropout_case(rank, world):
    """Attention and hidden dropout at cp 2: recomputation replays the masks; CP ranks draw their own."""
    ctx = build_context(world, rank, 1, 1, cp=2, seed=4)
    mb = global_batch(0, MICRO)[0]
    grads = {}
    for recompute in (None, "selective", "full"):
        cfg = model_cfg("llama")
        cfg.attention_dropout, cfg.hidden_dropout, cfg.recompute_granularity = 0.2, 0.1, recompute
        model = GPTModel(cfg, ctx, seed=9, vocab_size=VOCAB).train()
        states = ctx.rng.get_states(), torch.get_rng_state()
        model(mb["tokens"], labels=mb["labels"]).mean().backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
        ctx.rng.set_states(states[0])
        torch.set_rng_state(states[1])
    same = all(torch.equal(grads[None][n], grads[r][n]) for r in ("selective", "full") for n in grads[None])
    stream = ctx.rng.get_states()["tp"]
    ctx.destroy()
    return same, stream, torch.get_rng_state()


def test_dropout_under_cp_replays_under_recomputation_and_differs_by_cp_rank():
    results = run_ranks(_dropout_case, 2)
    assert all(same for same, _, _ in results), "recomputation changed the gradients under dropout"
    assert not torch.equal(results[0][1], results[1][1]) and not torch.equal(results[0][2], results[1][2])


# ---------------------------------------------------------------- the benchmark's figures (README)

@pytest.mark.slow
def test_benchmark_activation_bytes_are_one_over_cp_and_ring_traffic_is_the_ring_volume():
    from benchmarks import context_parallel as bench
    rows = bench.summary(bench.run())
    assert [(r["cp"], r["comm"]) for r in rows] == bench.CASES
    for r in rows:
        assert r["saved"] == r["expected"], r  # exactly the tensor-by-tensor set at s/cp tokens
        assert abs(r["of_cp1"] - 1 / r["cp"]) < 0.01, r
        assert r["sent"] == r["analytic"], r
        assert r["flop_balance"] <= 1.05, r

"""Sliding-window attention (--window-size L,0 and --window-attn-skip-freq) in every attention path.

The oracle is attention over a materialised mask built here, pair by pair, from the rule "the query at i sees
the key at j iff j <= i and i - j <= L" (Megatron-Core's get_sliding_window_causal_mask). Checked against it
in fp32: the reference, SDPA and Triton (interpreter on CPU) kernels, values and gradients; the block
kernels at context-parallel offsets merged by their log-sum-exp; the Triton kernels' visited blocks
counted against the blocks holding any visible pair. Under context parallelism (cp 2 and 4, p2p and
all_gather): attention and a whole windowed model equal one rank (1e-5), the ring skips the steps no rank
needs and counts exactly the visible pairs. The flags' meaning and mistakes, and the FLOP and planner
formulas. Hugging Face's Mistral/Qwen2/Mixtral windows: tests/test_hf_window.py. Budget on two cores:
about 15 s (one 4-rank pool run of all the context-parallel cases).
"""
import math

import pytest
import torch

import test_kernels as tk  # first: on CPU it points Triton at its interpreter before any kernel is defined
from engine import flops
from engine.attention_mask import AttentionMask, mean_keys_per_query
from engine.cli import parse_config
from engine.config import Config, ConfigError, ModelConfig
from engine.flops import GPU_PRESETS
from engine.layout import Layout
from engine.model import GPTModel
from engine.parallel import context_split, ring_attention
from engine.parallel.ring_attention import ContextAttention
from engine.parallel.topology import ParallelContext, build_context
from engine.planner.activations import layer_activation_bytes
from engine.planner.layer_time import _attention_seconds
from engine.planner.software import Software
from engine.validation import validate
from harness import NO_DROPOUT, run_ranks
from kernels import dispatch, reference

WINDOWS = [0, 1, 5, 17, None]  # in tokens before the query; 17 crosses blocks, None is plain causal


def exact_zero(window) -> tuple:
    """The inputs whose gradient the relative comparison skips: with window 0 a query sees only its own key,
    with probability 1 whatever the scores, so dq and dk are exactly 0 and a kernel's rounding (1e-8) has no
    relative error to speak of."""
    return (0, 1) if window == 0 else ()


def visible_mask(sq, sk, window, causal=True, q0=0, k0=0, queries=None, keys=None):
    """[sq, sk] bool, pair by pair: the oracle's mask of queries at q0.. (or `queries`) and keys at k0.. (`keys`)."""
    queries, keys = queries or range(q0, q0 + sq), keys or range(k0, k0 + sk)
    return torch.tensor([[(not causal or j <= i) and (window is None or i - j <= window) for j in keys]
                         for i in queries])


def oracle(q, k, v, window, causal=True):
    """Softmax attention over the materialised mask, grouped-query heads repeated, in the inputs' dtype."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible_mask(q.shape[1], k.shape[1], window, causal), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def qkv(b=2, s=45, nq=4, nkv=2, d=16, seed=5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(device) for n in (nq, nkv, nkv)]


# ---------------------------------------------------------------- the flags and the value


def _model(**kw) -> ModelConfig:
    return ModelConfig(**{"num_layers": 6, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 64,
                          "vocab_size": 64} | NO_DROPOUT | kw)


@pytest.mark.parametrize("skip,windowed", [
    (None, [1, 1, 1, 1, 1, 1]),
    ("3", [1, 1, 0, 1, 1, 0]),             # Megatron-Core: layer_number % 3 != 0, counting from 1
    ("1", [0, 0, 0, 0, 0, 0]),
    ("[1,1,0]*2", [1, 1, 0, 1, 1, 0]),      # 1: the window, 0: full attention
    ("([0]+[1]*2)*2", [0, 1, 1, 0, 1, 1]),
])
def test_window_flags_mean_what_megatron_core_means(skip, windowed):
    argv = ["--num-layers", "6", "--window-size", "4,0", "--mock-data"]
    argv += ["--window-attn-skip-freq", skip] if skip else []
    m = parse_config(argv).model
    assert [m.attention_window(i) for i in range(6)] == [4 if w else None for w in windowed]
    assert [AttentionMask.of(m, i) for i in range(6)] == [AttentionMask(window=4 if w else None) for w in windowed]
    assert _model(window_size="-1,0").attention_window(0) is None  # -1: no bound
    assert _model(window_size=[4, 0]).attention_window(0) == 4     # a YAML list


@pytest.mark.parametrize("fields,flag", [
    ({"window_size": "4,1"}, "the right side must be 0"),
    ({"window_size": "4"}, "give L,R"),
    ({"window_size": "-2,0"}, "give L,R"),
    ({"window_attn_skip_freq": "2"}, "--window-attn-skip-freq 2: picks the layers without --window-size"),
    ({"window_size": "4,0", "window_attn_skip_freq": "[1,0]"}, "a list of 6 0/1 values"),
    ({"window_size": "4,0", "window_attn_skip_freq": "0"}, "must be at least 1"),
    ({"window_size": "4,0", "window_attn_skip_freq": "[1,2]*3"}, "a list of 6 0/1 values"),
])
def test_window_mistakes_are_one_line(fields, flag):
    cfg = Config()
    cfg.model, cfg.data.mock_data = _model(**fields), True
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert flag in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_mask_decides_ranges_of_positions_as_pair_by_pair():
    for mask in (AttentionMask(), AttentionMask(window=0), AttentionMask(window=3), AttentionMask(causal=False),
                 AttentionMask(causal=False, window=2)):
        for q0, k0 in ((0, 0), (8, 0), (8, 4), (4, 9), (12, 3), (20, 0)):
            queries, keys = range(q0, q0 + 4), range(k0, k0 + 4)
            seen = visible_mask(4, 4, mask.window, mask.causal, q0, k0)
            assert mask.sees_any(queries, keys) == bool(seen.any()), (mask, q0, k0)
            assert mask.sees_all(queries, keys) == bool(seen.all()), (mask, q0, k0)
            assert mask.pairs(queries, keys) == int(seen.sum()), (mask, q0, k0)


def test_flops_and_planner_count_the_window():
    """Each windowed query counts the L + 1 keys of its window (engine/attention_mask.py's convention)."""
    s, full = 4096, _model(num_layers=4)
    attention = lambda m: flops.forward_flops_per_sequence(m, s)["attention"]  # noqa: E731
    assert attention(_model(num_layers=4, window_size="1023,0")) == attention(full) / 4
    assert attention(_model(num_layers=4, window_size="4095,0")) == attention(full)  # as long as the sequence
    mixed = _model(num_layers=4, window_size="1023,0", window_attn_skip_freq="2")  # layers 1 and 3 full
    assert attention(mixed) == attention(full) * (2 * 1024 + 2 * 4096) / (4 * 4096)
    assert mean_keys_per_query(mixed, s) == (2 * 1024 + 2 * 4096) / 4
    assert flops.flops_per_iteration(mixed, 8, s) < flops.flops_per_iteration(full, 8, s)
    stored = lambda m, flash: layer_activation_bytes(m, s, 1, flash_attention=flash)  # noqa: E731
    assert stored(mixed, False) < stored(full, False) and stored(mixed, True) == stored(full, True)  # scores only
    seconds = lambda m: _attention_seconds(m, Layout(), s, GPU_PRESETS["h100-sxm"], Software())[0]  # noqa: E731
    assert seconds(mixed) == pytest.approx(seconds(full) * (2 * 1024 + 2 * 4096) / (4 * 4096))


# ---------------------------------------------------------------- kernels against the materialised mask


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_reference_and_sdpa_equal_the_materialised_mask(backend):
    for window in WINDOWS:
        tk._compare(lambda *t: dispatch.attention(*t, backend=backend, window=window),
                    lambda *t: oracle(*t, window), qkv(s=23, d=8), constant=exact_zero(window))
    q, k, _ = qkv(s=23, d=8)
    lse = (torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / math.sqrt(8)).masked_fill(
        ~visible_mask(23, 23, 5), float("-inf")).logsumexp(-1)
    assert tk._rel_err(reference.attention_lse(q, k, window=5), lse) < 1e-6


@tk.needs_triton
def test_triton_equals_the_materialised_mask_and_skips_the_hidden_blocks():
    """Values and gradients, and the blocks each kernel's loops visit: exactly those holding a visible pair."""
    fa = tk._tk("flash_triton")
    b, s, nq, nkv, d = 1, 45, 2, 1, 16
    (bm, bn, _, _), (m1, n1, _, _), (m2, n2, _, _) = fa._configs(d, torch.float32, tk.CUDA)
    visited = {}
    for window in WINDOWS:
        q, k, v = qkv(b, s, nq, nkv, d, device=tk.DEVICE)
        with fa.counting() as visits:
            tk._compare(lambda *t: fa.flash_attention(*t, window=window), lambda *t: oracle(*t, window), [q, k, v],
                        constant=exact_zero(window))
        _, lse = fa.forward(q, k, v, True, None, window)
        assert tk._rel_err(lse, reference.attention_lse(q, k, window=window)) < 1e-5
        seen = visible_mask(s, s, window)
        touched = lambda rows, cols: b * nq * sum(bool(seen[i:i + rows, j:j + cols].any())  # noqa: E731
                                                  for i in range(0, s, rows) for j in range(0, s, cols))
        want = {"forward": touched(bm, bn), "dkdv": touched(m1, n1), "dq": touched(m2, n2)}
        assert visits == want, (window, visits, want)
        visited[window] = visits["forward"]
    assert visited[0] < visited[5] < visited[None]  # the window's blocks skipped, not only masked


def _blockwise(q, k, v, window, backend, chunks=4):
    """Attention as the ring computes it, on one process: chunk pairs with any visible pair, each by the block
    kernels at its positions, merged by lse; backward from the merged lse."""
    fwd, bwd = dispatch.attention_block_fns(backend)
    mask, c = AttentionMask(window=window), q.shape[1] // chunks
    part = lambda t, i: t[:, i * c:(i + 1) * c]  # noqa: E731
    pairs = [(i, j) for i in range(chunks) for j in range(chunks)
             if mask.sees_any(range(i * c, (i + 1) * c), range(j * c, (j + 1) * c))]
    acc = [None] * chunks
    for i, j in pairs:
        acc[i] = ring_attention._merge(acc[i], *fwd(part(q, i), part(k, j), part(v, j), True, None,
                                                    window=window, q_offset=i * c, k_offset=j * c))
    out, lse = torch.cat([a[0] for a in acc], 1).to(q.dtype), torch.cat([a[1] for a in acc], 2)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.device, q.dtype)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, j in pairs:
        g = bwd(part(do, i), part(q, i), part(k, j), part(v, j), part(out, i), lse[..., i * c:(i + 1) * c], True,
                None, window=window, q_offset=i * c, k_offset=j * c)
        for total, got, at in zip(grads, g, (i, j, j)):
            part(total, at).add_(got.float())
    return out, do, grads, len(pairs)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=[tk.needs_triton, pytest.mark.slow])])
def test_block_kernels_at_offsets_merge_to_window_attention(backend):
    """Blocks whose rows partly see nothing (lse -inf) merge exactly; blocks wholly outside are not run."""
    for window in (2, 9, None):
        q, k, v = (tk._leaf(t) for t in qkv(s=32, device=tk.DEVICE))
        out, do, grads, blocks = _blockwise(q.detach(), k.detach(), v.detach(), window, backend)
        want = oracle(q, k, v, window)
        want.backward(do)
        assert tk._rel_err(out, want) < 1e-5 and blocks == {2: 7, 9: 9, None: 10}[window]
        for got, leaf in zip(grads, (q, k, v)):
            assert tk._rel_err(got, leaf.grad) < 1e-5, window


@tk.gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [255, 1000])
def test_gpu_window_attention(window, dtype):
    q, k, v = qkv(2, 2048, 8, 2, 128, device="cuda")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    _, lse = tk._tk("flash_triton").forward(q, k, v, True, None, window)
    assert tk._rel_err(lse, reference.attention_lse(q, k, window=window)) < 1e-3
    tk._compare(lambda *t: dispatch.attention(*t, backend="triton", window=window),
                lambda *t: reference.attention(*t, window=window), [q, k, v], tol=2e-2)
    _, do, grads, _ = _blockwise(q, k, v, window, "triton")
    ref = [tk._leaf(t.float()) for t in (q, k, v)]
    reference.attention(*ref, window=window).backward(do.float())
    assert all(tk._rel_err(g, r.grad) < 2e-2 for g, r in zip(grads, ref))


# ---------------------------------------------------------------- context parallelism against one rank

SEQ, VOCAB = 32, 64


def _attention_cases(ctx, window, causal=True):
    """ContextAttention (the reference block kernels) against the oracle; (failures, flops, ring steps)."""
    full = [t.requires_grad_() for t in qkv(s=SEQ, d=8)]
    want = oracle(*full, window, causal)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(6))
    want.backward(dout)
    cut = lambda t: context_split.split(t, 1, ctx.cp_size, ctx.cp_rank)  # noqa: E731
    local = [cut(t.detach()).requires_grad_() for t in full]
    with ring_attention.counting() as counted:
        out = ContextAttention(ctx, "reference")(*local, AttentionMask(causal, window))
        out.backward(cut(dout))
    failures = []
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in local],
                              [want.detach()] + [t.grad for t in full]):
        err = (got - cut(ref)).abs().max().item()
        if err > 1e-5:
            failures.append(f"cp {ctx.cp_size} {ctx.cp_comm_type} window {window} causal {causal}: {name} {err:.3g}")
    return failures, counted.forward, counted.steps


def _window_model(window_size, skip=None):
    return ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
                       vocab_size=VOCAB, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                       window_size=window_size, window_attn_skip_freq=skip, make_vocab_size_divisible_by=16,
                       init_method_std=0.3)  # large enough that attention, and so the window, moves the loss


def _model_case(ctx, window_size, skip):
    """A windowed model's mean loss and gradients on this CP rank's tokens, summed over the CP group."""
    import torch.distributed as dist
    model = GPTModel(_window_model(window_size, skip), ctx, seed=9, vocab_size=VOCAB)
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    mine = context_split.shard_batch({"tokens": t[:, :-1], "labels": t[:, 1:]}, ctx)
    loss = model(tokens=mine["tokens"], labels=mine["labels"], positions=mine["positions"]).sum() / t[:, 1:].numel()
    loss.backward()
    total, grads = loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in [total] + list(grads.values()):
        dist.all_reduce(g, group=ctx.cp_group)
    return total.item(), grads


def _cp_rank(rank, world):
    results = {}
    for cp in (2, 4):
        for comm_type in ("p2p", "all_gather"):
            ctx = build_context(world, rank, 1, 1, cp=cp, cp_comm_type=comm_type, seed=9)
            for window in (2, 5, None):
                results[cp, comm_type, window] = _attention_cases(ctx, window)
            results[cp, comm_type, "non-causal"] = _attention_cases(ctx, 3, causal=False)
            results[cp, comm_type, "model"] = _model_case(ctx, "2,0", "[1,0]")
            ctx.destroy()
    return results


def _ring_steps(cp: int, rank: int, window) -> int:
    """The owners whose positions hold a key some position of `rank` sees: the steps it must compute."""
    mine = context_split.positions(SEQ, cp, rank).tolist()
    return sum(bool(visible_mask(0, 0, window, queries=mine, keys=context_split.positions(SEQ, cp, owner).tolist())
                    .any()) for owner in range(cp))


def test_window_under_cp_equals_one_rank_skips_ring_steps_and_counts_the_visible_pairs():
    ranks = run_ranks(_cp_rank, 4, timeout=240)
    problems = [f for res in ranks for key, (failures, *_) in res.items() if key[2] != "model" for f in failures]
    assert not problems, "\n".join(problems)
    b, nq, d = 2, 4, 8
    for cp in (2, 4):
        for comm_type in ("p2p", "all_gather"):
            for window, causal in ((2, True), (5, True), (None, True), ("non-causal", False)):
                per_rank = [res[cp, comm_type, window] for res in ranks]
                groups = 4 // cp  # the CP groups among the 4 ranks: each computes the whole attention once
                total = sum(r[1] for r in per_rank) / groups
                pairs = int(visible_mask(SEQ, SEQ, 3 if window == "non-causal" else window, causal).sum())
                assert math.isclose(total, 4.0 * b * nq * d * pairs, rel_tol=1e-9), (cp, comm_type, window, total)
            for window in (2, 5, None):
                steps = [res[cp, comm_type, window][2] for res in ranks]
                assert steps == [_ring_steps(cp, r % cp, window) for r in range(4)], (cp, comm_type, window, steps)
    assert [_ring_steps(4, r, 2) for r in range(4)] == [2, 3, 3, 2]  # a window shorter than a chunk: fewer than 4
    # and no rank has a block at offset 2, so the ring goes straight from offset 1 to 3
    assert [i for i, _, _ in ring_attention.plan(4, 0, 4, AttentionMask(window=2))] == [0, 1, 3]
    one = GPTModel(_window_model("2,0", "[1,0]"), ParallelContext(), seed=9, vocab_size=VOCAB)
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    loss = one(tokens=t[:, :-1], labels=t[:, 1:]).mean()
    loss.backward()
    plain = GPTModel(_window_model(None), ParallelContext(), seed=9, vocab_size=VOCAB)
    assert abs(plain(tokens=t[:, :-1], labels=t[:, 1:]).mean().item() - loss.item()) > 1e-4  # the window matters
    for key in [k for k in ranks[0] if k[2] == "model"]:
        for rank, res in enumerate(ranks):
            got_loss, grads = res[key]
            assert abs(got_loss - loss.item()) < 1e-5, (key, rank, got_loss, loss.item())
            for name, p in one.named_parameters():
                err = (grads[name] - p.grad).abs().max().item()
                assert err <= 1e-5 * p.grad.abs().max().item() + 1e-8, (key, rank, name, err)

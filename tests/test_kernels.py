"""Every fused kernel against its PyTorch reference, values and gradients.

Without a GPU the Triton kernels run on CPU under Triton's interpreter at tiny shapes (fp32); with one
they run compiled on CUDA, and the `gpu` cases add real sizes in bf16/fp16. Budget: about 15 s on a
2-core CPU machine (tests/test_kernels_compile.py adds a slow ~30-60 s ahead-of-time compile check).
"""
import importlib
import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede the definition of any @triton.jit function: the decorator picks the interpreter then.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:
        _interp = None
    # Triton 3.6's interpreter holds scalars as 1-element arrays and int()s them for `range` bounds,
    # which numpy >= 2.4 rejects; .item() is what it means.
    _orig_patch = getattr(_interp, "_patch_lang_tensor", None)
    if _orig_patch is not None:
        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        _interp._patch_lang_tensor = _patch_lang_tensor
    for _name in ("norm_triton", "rope_triton", "swiglu_triton", "fp8_triton", "ce_triton", "flash_triton_jit",
                  "flash_triton"):
        if f"kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"kernels.{_name}"])

from engine.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from engine.parallel.topology import ParallelContext  # noqa: E402
from harness import run_in_fresh_process  # noqa: E402
from kernels import dispatch, reference  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not dispatch.triton_available(), reason="triton is not installed")


def gpu_test(fn):
    """Real-size case: needs CUDA and triton; skipped, with the reason, elsewhere."""
    fn = needs_triton(fn)
    fn = pytest.mark.skipif(not CUDA, reason="no CUDA device: real-size kernel checks need a GPU")(fn)
    return pytest.mark.gpu(fn)


def _tk(name):
    return importlib.import_module(f"kernels.{name}")


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _compare(fn_test, fn_ref, inputs, grad_seed=0, tol=1e-5, constant=()):
    """Runs both functions on copies of `inputs`, backpropagates the same random cotangents, and checks
    the outputs and every input gradient agree (relative Frobenius error). The reference runs on fp32
    copies, so for half-precision inputs it is the more accurate of the two. Inputs whose index is in
    `constant` get no gradient."""
    diff = [isinstance(t, torch.Tensor) and t.is_floating_point() and i not in constant for i, t in enumerate(inputs)]
    a_in = [_leaf(t) if d else t for t, d in zip(inputs, diff)]
    b_in = [_leaf(t.float()) if d else t for t, d in zip(inputs, diff)]
    out_a, out_b = fn_test(*a_in), fn_ref(*b_in)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    gen = torch.Generator(device="cpu").manual_seed(grad_seed)
    cots = [torch.randn(o.shape, generator=gen).to(o.device) for o in out_a]
    for oa, ob in zip(out_a, out_b):
        assert oa.shape == ob.shape
        assert _rel_err(oa, ob) < tol, f"output mismatch {_rel_err(oa, ob)}"
    torch.autograd.backward(out_a, [c.to(o.dtype) for c, o in zip(cots, out_a)])
    torch.autograd.backward(out_b, [c.to(o.dtype) for c, o in zip(cots, out_b)])
    for i, (ta, tb) in enumerate(zip(a_in, b_in)):
        if isinstance(ta, torch.Tensor) and ta.requires_grad:
            assert ta.grad is not None and _rel_err(ta.grad, tb.grad) < tol, f"grad {i} mismatch"


NORMS = {
    "rms": (lambda m: m.rms_norm, lambda x, r, w, b: (x, w, 1e-5)),
    "layer": (lambda m: m.layer_norm, lambda x, r, w, b: (x, w, b, 1e-5)),
    "layer_nobias": (lambda m: m.layer_norm, lambda x, r, w, b: (x, w, None, 1e-5)),
    "add_rms": (lambda m: m.add_rms_norm, lambda x, r, w, b: (x, r, w, 1e-5)),
    "add_layer": (lambda m: m.add_layer_norm, lambda x, r, w, b: (x, r, w, b, 1e-5)),
    "add_layer_nobias": (lambda m: m.add_layer_norm, lambda x, r, w, b: (x, r, w, None, 1e-5)),
}


def _norm_inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(device, dtype)
    r = torch.randn(shape, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    b = (0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    return x, r, w, b


@needs_triton
@pytest.mark.parametrize("variant", sorted(NORMS))
def test_norms_match_reference(variant):
    pick, args = NORMS[variant]
    # 48 is not a power of two: exercises the masked tail of the row.
    inputs = _norm_inputs((2, 3, 48), torch.float32, DEVICE)
    _compare(pick(_tk("norm_triton")), pick(reference), list(args(*inputs)))


def _norm_run(fn, inputs):
    """One norm call and its backward under fixed random cotangents: (outputs, cotangents, input gradients, None
    where an input is not a tensor)."""
    leaves = [_leaf(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(0)
    cots = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, cots)
    return outs, cots, [t.grad if isinstance(t, torch.Tensor) else None for t in leaves]


def _abs_weight_terms(inputs, dy, variant):
    """Per column, the sum over rows of |dy * xhat| (dw's terms) and of |dy| (db's), in float64."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 1]
    s = sum(t.double() for t in tensors).reshape(-1, dy.shape[-1])  # the residual variants normalise x + r
    if "rms" not in variant:
        s = s - s.mean(-1, keepdim=True)
    xhat = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    dy = dy.double().reshape(xhat.shape)
    return (dy * xhat).abs().sum(0), dy.abs().sum(0)


@needs_triton
def test_norm_backward_takes_fewer_rows_an_iteration_where_a_thread_would_hold_too_many():
    """The launch the H200 sweep chose (2 rows an iteration at 16 warps for hidden 8192: 32 elements a thread) holds;
    wider rows or fewer warps fall back towards one row (the sweep's 2 rows at 4 warps spilled); not a power of two
    is refused."""
    from unittest import mock
    norm_triton = _tk("norm_triton")
    assert norm_triton._launch_config(8192) == (8192, 16) and norm_triton._bwd_rows(8192, 16) == 2
    assert norm_triton._launch_config(2048) == (2048, 8) and norm_triton._bwd_rows(2048, 8) == 2
    assert norm_triton._bwd_rows(16384, 16) == 1 and norm_triton._bwd_rows(8192, 4) == 1
    # LayerNorm keeps more per row (its means, the bias gradient): half the elements a thread
    assert norm_triton._bwd_rows(8192, 16, is_rms=False) == 1 and norm_triton._bwd_rows(4096, 16, is_rms=False) == 2
    with mock.patch.object(norm_triton, "BWD_ROWS_PER_ITER", 4):
        assert norm_triton._bwd_rows(8192, 16) == 2 and norm_triton._bwd_rows(64, 1) == 4
    with mock.patch.object(norm_triton, "BWD_ROWS_PER_ITER", 3), pytest.raises(ValueError, match="power of two"):
        norm_triton._bwd_rows(64, 1)


@needs_triton
@pytest.mark.parametrize("variant", sorted(NORMS))
def test_norm_backward_rows_per_iteration(variant):
    """The backward's BWD_ROWS_PER_ITER at 1, 2 and 4 rows a loop iteration: every gradient equals the reference,
    and 2 and 4 equal 1. Row counts 13 and 10 are multiples of no rows x programs (4 programs under the
    interpreter; at 10 the stripe rounds up from 3 rows to 4 at 2 and 4, so fewer programs run), so the last
    block of a stripe holds rows past M; hidden 48 and 40 are not powers of two. dx is computed row by row in the
    same order whatever the block's row count, so it is identical under the interpreter (on a GPU the compiled
    per-row sums may split a row differently: 1e-6 there). dw and db add the same fp32 terms in another order
    (a block's rows summed first, then into the program's running share; fewer programs' shares at the end), so
    they may differ, by at most twice the recursive-summation bound (M - 1) * 2**-24 * sum |term| (Higham,
    Accuracy and Stability of Numerical Algorithms, 4.2) per column."""
    from unittest import mock
    norm_triton = _tk("norm_triton")
    pick, args = NORMS[variant]
    for shape in ((13, 48), (2, 5, 40)):
        inputs = list(args(*_norm_inputs(shape, torch.float32, DEVICE)))
        ref_outs, _, ref_grads = _norm_run(pick(reference), inputs)
        runs = {}
        for rows in (1, 2, 4):
            with mock.patch.object(norm_triton, "BWD_ROWS_PER_ITER", rows):
                runs[rows] = outs, cots, grads = _norm_run(pick(norm_triton), inputs)
            for a, b in zip(outs, ref_outs):
                assert _rel_err(a, b) < 1e-5, (shape, rows)
            for i, (a, b) in enumerate(zip(grads, ref_grads)):
                assert (a is None) == (b is None) and (a is None or _rel_err(a, b) < 1e-5), (shape, rows, i)
        m = ref_grads[0].numel() // shape[-1]
        w_terms, b_terms = _abs_weight_terms(inputs, runs[1][1][0], variant)
        for rows in (2, 4):
            for a, b in zip(runs[rows][0], runs[1][0]):
                assert torch.equal(a, b)
            vectors = iter((w_terms, b_terms))  # the 1-D inputs are the weight, then the bias if any
            for t, a, b in zip(inputs, runs[rows][2], runs[1][2]):
                if a is None:
                    continue
                if t.dim() > 1:  # dx (x's gradient, and the residual's, which is the same)
                    assert torch.equal(a, b) if not CUDA else _rel_err(a, b) < 1e-6, (shape, rows)
                else:
                    bound = 2 * (m - 1) * 2.0 ** -24 * next(vectors)
                    assert torch.all((a.double() - b.double()).abs().cpu() <= bound.cpu()), (shape, rows)


@needs_triton
def test_rope_matches_reference_on_strided_input():
    g = torch.Generator().manual_seed(2)
    big = torch.randn(5, 2, 3, 24, generator=g).to(DEVICE)
    x = big[..., 4:20]  # [s, b, n, 16] view with a head stride of 24, as a slice of a fused qkv tensor
    freqs = (torch.rand(5, 8, generator=g) * 6).to(DEVICE)
    _compare(_tk("rope_triton").apply_rope, reference.apply_rope, [x, freqs], constant=(1,))


@needs_triton
def test_rope_rows_per_program():
    """ROWS_PER_PROGRAM 1, 2 and 4 rotate the same numbers, forward and backward, bit for bit (each row computed
    alike), for shared angles and per-sample angles, with 5 x 3 = 15 rows: the last program holds rows past the
    end, which must neither be read nor written."""
    from unittest import mock
    rope_triton = _tk("rope_triton")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 3, 16, generator=g).to(DEVICE)
    dy = torch.randn(5, 3, 3, 16, generator=g).to(DEVICE)
    for freqs in ((torch.rand(5, 8, generator=g) * 6).to(DEVICE), (torch.rand(5, 3, 8, generator=g) * 6).to(DEVICE)):
        runs = []
        for rows in (1, 2, 4):
            xg = x.clone().requires_grad_()
            with mock.patch.object(rope_triton, "ROWS_PER_PROGRAM", rows):
                y = rope_triton.apply_rope(xg, freqs)
                y.backward(dy)
            runs.append((y.detach(), xg.grad))
        want = reference.apply_rope(x, freqs)
        assert _rel_err(runs[0][0], want) < 1e-5
        for y, dx in runs[1:]:
            assert torch.equal(y, runs[0][0]) and torch.equal(dx, runs[0][1])


@needs_triton
def test_swiglu_matches_reference_on_chunked_input():
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(3, 4, 80, generator=g).to(DEVICE) * 3
    gate, up = fused.chunk(2, dim=-1)
    _compare(_tk("swiglu_triton").swiglu, reference.swiglu, [gate, up])


@needs_triton
def test_swiglu_stacked_gives_the_halves_values_and_writes_their_gradient_as_one_tensor():
    """swiglu_stacked(y) equals swiglu on y's halves bit for bit, values and gradient; the gradient comes out of the
    kernel as one tensor shaped like y, where the halves' gradients are joined by a concatenation (autograd's)."""
    tk = _tk("swiglu_triton")
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(3, 4, 80, generator=g).to(DEVICE) * 3
    dy = torch.randn(3, 4, 40, generator=g).to(DEVICE)
    a, b = _leaf(fused), _leaf(fused)
    ya, yb = tk.swiglu_stacked(a), tk.swiglu(*b.chunk(2, dim=-1))
    assert torch.equal(ya, yb)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(a.grad, b.grad)
    assert ya.grad_fn.name().endswith("_StackedSwiGLUBackward")  # nothing between it and the input: no concatenation
    assert ya.grad_fn.next_functions[0][0].name() == "torch::autograd::AccumulateGrad"
    with pytest.raises(ValueError, match="even last dimension"):
        tk.swiglu_stacked(fused[..., :79])


def _ce_case(n, v, valid, vocab_start, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(n, v, generator=g) * 4).to(device, dtype)
    # Half the targets fall inside this shard [vocab_start, vocab_start + valid), half outside it.
    inside = vocab_start + torch.randint(0, valid, (n,), generator=g)
    outside = torch.randint(0, max(vocab_start, 1), (n,), generator=g)
    target = torch.where((torch.arange(n) % 2 == 0) | (vocab_start == 0), inside, outside).to(device)
    return logits, target


def _ce_explicit(logits, target, vocab_start, valid):
    x = logits[:, :valid].double()
    m = x.amax(1)
    local = target - vocab_start
    inside = (local >= 0) & (local < valid)
    t = torch.where(inside, x.gather(1, local.clamp(0, valid - 1)[:, None])[:, 0], torch.zeros_like(m))
    return m, (x - m[:, None]).exp().sum(1), t


@needs_triton
def test_ce_stats_and_grad_match_reference():
    n, v, valid, start = 6, 70, 64, 128
    logits, target = _ce_case(n, v, valid, start, DEVICE)
    logits[:, valid:] = 1e4  # padding columns must be ignored even when huge
    target[1] = start + valid + 2  # an id that lands in this shard's padding belongs to no column
    ce = _tk("ce_triton")
    got = ce.ce_stats(logits, target, start, valid)
    explicit = _ce_explicit(logits, target, start, valid)
    for a, b, c in zip(got, reference.ce_stats(logits, target, start, valid), explicit):
        assert _rel_err(a, c) < 1e-6 and _rel_err(b, c) < 1e-6
    m, s, _ = got
    lse = m + s.log()
    coef_s = torch.linspace(0.5, 1.5, n, device=DEVICE)
    coef_o = torch.linspace(1.0, 2.0, n, device=DEVICE)
    grad = ce.ce_grad(logits, target, start, valid, lse, coef_s, coef_o)
    ref = reference.ce_grad(logits, target, start, valid, lse, coef_s, coef_o)
    expect = torch.zeros(n, v, dtype=torch.float64, device=DEVICE)
    expect[:, :valid] = (logits[:, :valid].double() - lse[:, None].double()).exp() * coef_s[:, None].double()
    rows = torch.arange(n, device=DEVICE)[::2]
    expect[rows, target[rows] - start] -= coef_o[rows].double()
    assert _rel_err(grad, expect) < 1e-6 and _rel_err(ref, expect) < 1e-6
    assert torch.all(grad[:, valid:] == 0)
    same = ce.ce_grad(logits, target, start, valid, lse, coef_s, coef_o, inplace=True)
    assert same.data_ptr() == logits.data_ptr() and _rel_err(same, expect) < 1e-6


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_cross_entropy_matches_torch(z_loss):
    logits, target = _ce_case(5, 33, 33, 0, DEVICE)
    ref_in = _leaf(logits).double().detach().requires_grad_(True)
    lse = ref_in.logsumexp(1)
    expect = F.cross_entropy(ref_in, target, reduction="none") + z_loss * lse ** 2
    got_in = _leaf(logits)
    # The engine's vocabulary-parallel cross-entropy on one rank is the whole op (ce_stats, then ce_grad in place).
    got = vocab_parallel_cross_entropy(got_in, target, ParallelContext(), 33, z_loss_weight=z_loss,
                                       inplace_backward=False)
    weights = torch.linspace(0.1, 1.0, 5, device=DEVICE)
    (got * weights).sum().backward()
    (expect * weights).sum().backward()
    assert _rel_err(got, expect) < 1e-5 and _rel_err(got_in.grad, ref_in.grad) < 1e-5


def _qkv(b, s, nq, nkv, d, device, dtype=torch.float32, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(device, dtype) for n in (nq, nkv, nkv)]


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 40, 4, 2, 16), (1, 33, 2, 2, 64)], ids=["gqa-d16", "mha-d64"])
def test_flash_attention_matches_reference(causal, shape):
    q, k, v = _qkv(*shape, DEVICE)
    fa = _tk("flash_triton")
    out, lse = fa.forward(q, k, v, causal)
    assert _rel_err(lse, reference.attention_lse(q, k, causal)) < 1e-5
    assert _rel_err(out, reference.attention(q, k, v, causal)) < 1e-5
    _compare(lambda *t: fa.flash_attention(*t, causal=causal, softmax_scale=0.3),
             lambda *t: reference.attention(*t, causal=causal, softmax_scale=0.3), [q, k, v])


def _narrow_values_by_hand(q, k, v, scale):
    """Causal attention written out, values narrower than q and k (multi-head latent attention's shape)."""
    s = q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1).to(q.device), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["local", "sdpa", pytest.param("triton", marks=needs_triton)])
def test_values_narrower_than_queries_and_keys_through_the_entry_point(backend):
    """The attention entry point (engine.parallel.attention) takes v with fewer channels than q and k (MLA: 128
    against 192 in DeepSeek-V3) on every kernel: values and gradients equal attention written out."""
    from engine.attention_mask import AttentionMask
    from engine.parallel.attention import attention_for
    if backend == "triton" and not CUDA:
        attend = attention_for(ParallelContext.virtual(), "triton", "cpu")  # the kernel under the interpreter
    else:
        attend = attention_for(ParallelContext.virtual(), backend, DEVICE)
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(2, 24, 4, 24, generator=g).to(DEVICE) for _ in range(2))
    v = torch.randn(2, 24, 4, 16, generator=g).to(DEVICE)
    _compare(lambda *t: attend(*t, AttentionMask(), 0.0, 0.3), lambda *t: _narrow_values_by_hand(*t, 0.3), [q, k, v])


def _blockwise(q, k, v, chunks: int, backend: str):
    """Causal attention as the context-parallel ring computes it, on one process: the sequence in `chunks`
    chunks, every (query chunk, earlier-or-same key chunk) block by the block kernels, merged by lse."""
    from engine.parallel.ring_attention import _merge
    fwd, bwd = dispatch.attention_block_fns(backend)
    c = q.shape[1] // chunks
    part = lambda t, i: t[:, i * c:(i + 1) * c]  # noqa: E731
    outs, lses = [], []
    for i in range(chunks):
        acc = None
        for j in range(i + 1):
            acc = _merge(acc, *fwd(part(q, i), part(k, j), part(v, j), i == j, None))
        outs.append(acc[0].to(q.dtype))
        lses.append(acc[1])
    out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.device, q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for i in range(chunks):
        for j in range(i + 1):
            g = bwd(part(do, i), part(q, i), part(k, j), part(v, j), part(out, i), lse[..., i * c:(i + 1) * c], i == j,
                    None)
            part(dq, i).add_(g[0].float())
            part(dk, j).add_(g[1].float())
            part(dv, j).add_(g[2].float())
    return out, do, (dq, dk, dv)


def _blockwise_against_full(shape, device, dtype, backend, tol):
    q, k, v = (_leaf(t) for t in _qkv(*shape, device, dtype))
    out, do, grads = _blockwise(q.detach(), k.detach(), v.detach(), 4, backend)
    ref = reference.attention(q, k, v, causal=True)
    ref.backward(do)
    assert _rel_err(out, ref) < tol
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert _rel_err(got, want) < tol


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_attention_blocks_merged_by_lse_equal_full_causal_attention(backend):
    """The block kernels context parallelism merges (kernels.dispatch.attention_block_fns): the Triton one
    must return the log-sum-exp and take the merged lse in backward."""
    _blockwise_against_full((2, 32, 4, 2, 16), DEVICE, torch.float32, backend, 1e-5)


@gpu_test
def test_attention_blocks_merged_by_lse_real_size_bf16():
    _blockwise_against_full((2, 2048, 16, 4, 128), "cuda", torch.bfloat16, "triton", 2e-2)


def test_resolve_attention_backend():
    assert dispatch.resolve_attention_backend("auto", "cpu") == "sdpa"
    assert dispatch.resolve_attention_backend("local", "cpu") == "local"
    with pytest.raises(ValueError, match="unknown"):
        dispatch.resolve_attention_backend("xformers", "cpu")
    with pytest.raises(ValueError, match="triton"):
        dispatch.resolve_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="flash"):
        dispatch.resolve_attention_backend("flash", "cpu")
    report = dispatch.kernel_report("cpu")
    assert report["rms_norm"] == "reference" and report["attention"] == "sdpa"
    if dispatch.triton_available():  # resolution needs no GPU, only the device's kind
        assert dispatch.resolve_attention_backend("triton", "cuda") == "triton"
        assert dispatch.resolve_attention_backend("auto", "cuda", dtype=torch.float32) == "sdpa"
        assert dispatch.resolve_attention_backend("auto", "cuda", dropout_p=0.1) in ("flash", "sdpa")
        assert dispatch.resolve_attention_backend("auto", "cuda", dtype=torch.bfloat16) in ("flash", "sdpa-fused")
        with pytest.raises(ValueError, match="dropout"):
            dispatch.resolve_attention_backend("triton", "cuda", dropout_p=0.1)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_and_local_backends_agree(causal):
    q, k, v = _qkv(2, 12, 6, 2, 8, "cpu")
    _compare(lambda *t: dispatch.attention(*t, causal=causal, backend="sdpa", softmax_scale=0.5),
             lambda *t: dispatch.attention(*t, causal=causal, backend="local", softmax_scale=0.5), [q, k, v])


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_with_key_value_heads_repeated_equals_grouped_query(causal, monkeypatch):
    """The form SDPA gets on CUDA in fp32 (dispatch._expand_kv_heads): every kv head repeated for its queries
    computes what enable_gqa does, gradients folded back onto the shared heads."""
    q, k, v = _qkv(2, 12, 6, 2, 8, "cpu")
    grouped = lambda *t: dispatch.attention(*t, causal=causal, backend="sdpa")  # noqa: E731
    monkeypatch.setattr(dispatch, "_expand_kv_heads", lambda q: True)
    _compare(grouped, lambda *t: reference.attention(*t, causal=causal), [q, k, v])


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_attention_dropout(backend):
    q, k, v = _qkv(1, 16, 2, 1, 8, "cpu")
    plain = dispatch.attention(q, k, v, backend=backend)
    torch.manual_seed(0)
    a = dispatch.attention(q, k, v, dropout_p=0.5, backend=backend)
    torch.manual_seed(0)
    b = dispatch.attention(q, k, v, dropout_p=0.5, backend=backend)
    torch.manual_seed(1)
    c = dispatch.attention(q, k, v, dropout_p=0.5, backend=backend)
    assert torch.equal(a, b) and not torch.allclose(a, plain) and not torch.allclose(a, c)


def test_dispatch_works_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch; from kernels import dispatch\n"
            "assert not dispatch.triton_available()\n"
            "x = torch.randn(2, 8, requires_grad=True)\n"
            "dispatch.rms_norm(x, torch.ones(8), 1e-5).sum().backward()\n"
            "print(dispatch.kernel_report('cuda'))\n")
    printed = run_in_fresh_process(code, "'rms_norm': 'reference'", timeout=120)
    assert "'attention': 'triton'" not in printed


def test_dispatch_on_cpu_uses_references():
    x, r, w, b = _norm_inputs((3, 16), torch.float32, "cpu")
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    y, s = dispatch.add_layer_norm(x, r, w, b, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, reference.layer_norm(x + r, w, b, 1e-6))
    assert torch.equal(dispatch.swiglu(x, r), F.silu(x) * r)


# ---- real sizes on a GPU ------------------------------------------------------------------------------

@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", sorted(NORMS))
def test_gpu_norms(variant, dtype):
    pick, args = NORMS[variant]
    inputs = _norm_inputs((4, 1024, 4096), dtype, "cuda")
    _compare(pick(dispatch), pick(reference), list(args(*inputs)), tol=1e-2)


@gpu_test
def test_gpu_rope_and_swiglu():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2048, 2, 32, 128, generator=g).to("cuda", torch.bfloat16)
    freqs = torch.outer(torch.arange(2048.0), 10000.0 ** (-torch.arange(0, 128, 2) / 128)).cuda()
    _compare(dispatch.apply_rope, reference.apply_rope, [x, freqs], tol=1e-2, constant=(1,))
    fused = torch.randn(2, 4096, 2 * 11008, generator=g).to("cuda", torch.bfloat16)
    _compare(dispatch.swiglu, reference.swiglu, list(fused.chunk(2, dim=-1)), tol=1e-2)
    _compare(dispatch.swiglu_stacked, lambda y: reference.swiglu(*y.chunk(2, dim=-1)), [fused], tol=1e-2)


@gpu_test
def test_gpu_cross_entropy_128k_values_and_memory():
    n, v = 4096, 131072
    logits, target = _ce_case(n, v, v - 100, 0, "cuda", torch.bfloat16)
    stats = dispatch.ce_stats(logits, target, 0, v - 100)
    for a, b in zip(stats, reference.ce_stats(logits, target, 0, v - 100)):
        assert _rel_err(a, b) < 1e-5
    ref_loss = F.cross_entropy(logits.float(), target, reduction="none")
    x = _leaf(logits)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = vocab_parallel_cross_entropy(x, target, ParallelContext(), v)
    # autograd.grad, as the model's matmul would, takes the gradient without a leaf's .grad copy.
    (grad,) = torch.autograd.grad(loss.sum(), x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= n * v * 4 / 4, f"cross-entropy used {extra / 2**20:.0f} MiB beyond the logits"
    assert grad.data_ptr() == x.data_ptr()
    assert _rel_err(loss, ref_loss) < 1e-3
    expect = torch.softmax(logits.float(), 1)
    expect[torch.arange(n), target] -= 1
    assert _rel_err(grad, expect) < 1e-2


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1024, 1000])
def test_gpu_flash_attention(s, causal, d, dtype):
    q, k, v = _qkv(2, s, 8, 2, d, "cuda", dtype)
    out, lse = _tk("flash_triton").forward(q, k, v, causal)
    assert _rel_err(lse, reference.attention_lse(q, k, causal)) < 1e-3
    _compare(lambda *t: dispatch.attention(*t, causal=causal, backend="triton"),
             lambda *t: reference.attention(*t, causal=causal), [q, k, v], tol=2e-2)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_auto_attention_through_fused_sdpa(causal, d, dtype):
    """What `auto` resolves to on CUDA (SDPA's fused kernels; a window goes to the Triton kernel), grouped-query
    heads as the models have them, values and gradients against the fp32 reference."""
    assert dispatch.resolve_attention_backend("auto", "cuda", dtype=dtype) in ("flash", "sdpa-fused")
    q, k, v = _qkv(2, 2048, 16, 4, d, "cuda", dtype)
    _compare(lambda *t: dispatch.attention(*t, causal=causal), lambda *t: reference.attention(*t, causal=causal),
             [q, k, v], tol=2e-2)
    if causal:
        _compare(lambda *t: dispatch.attention(*t, causal=True, window=300),
                 lambda *t: reference.attention(*t, causal=True, window=300), [q, k, v], tol=2e-2)


@gpu_test
def test_gpu_auto_attention_keeps_its_kernel_under_torch_compile():
    """`auto`'s fused SDPA (kernels.dispatch._sdpa_fused) runs the same attention kernel, forward and backward,
    in a compiled graph as eagerly: its backend priority (cuDNN's first) holds under torch.compile, where left to
    SDPA's own order (flash first) compiled layers ran SDPA-flash. Grouped-query heads, as the Llama models have."""
    from torch.profiler import ProfilerActivity, profile
    fused = dispatch.attention_fn("sdpa-fused")
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2048, 16, 4, 128, "cuda", torch.bfloat16))

    def kernels(fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(q, k, v, True, 0.0, None).float().square().sum().backward()
        return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_")}

    compiled(q, k, v, True, 0.0, None)  # traced here, outside the profile
    eager = kernels(fused)
    assert any(name.endswith("_backward") for name in eager), eager
    assert kernels(compiled) == eager, f"eager ran {sorted(eager)}"


def test_benchmark_script_runs_and_writes_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "kernels_benchmark", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_speed.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    ops = "rms_norm,attention_d64"
    assert bench.main(["--out", str(out), "--ops", ops, "--reps", "1", "--quick"]) == 0
    report = json.loads(out.read_text())
    assert report["device"] and {r["kernel"] for r in report["results"]} == set(ops.split(","))
    assert all("error" not in r and r["fwd_ms"] > 0 for r in report["results"])
    assert "rms_norm" in capsys.readouterr().out
    assert bench.main(["--ops", "nope"]) == 2


"""Tensor-parallel layers and the vocabulary-parallel cross-entropy against one rank (fp32, CPU, gloo).

Each layer is built twice from the same full weights: at tp 1 (`ParallelContext()`) and sharded at tp 2
(x dp 2) or tp 4, with and without sequence parallelism. The sharded forward must give this rank's part
of the tp-1 output, and backward must give this rank's part of the input gradient and, once gathered
the way each parameter's `ParamSpec` says (sharded grads gathered along `tp_axis`, `sp_partial_grad`
ones summed over TP under sequence parallelism, vocabulary padding dropped), every parameter gradient.
The weights are random everywhere (biases and norm scales included) and padding rows and columns hold
large values, so a wrong slice or leaked padding shows. The cross-entropy is checked against
torch.nn.functional on the unsharded logits, z-loss included, with a shard made only of padding at tp 4.

Also `init_weights`: every tp draws slices of the same full tensors (virtual contexts, no processes).

Budget: about 10 s alone on a 2-core machine, about 12 s together with test_mappings.py (the pool of 4
ranks is started once and shared); each case takes about 0.1 s.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import padded_vocab_size
from engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.parallel.layers import (
    ColumnParallelLinear,
    Norm,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_weights,
    spec_of,
)
from engine.parallel.topology import ParallelContext, build_context
from harness import full_grad, run_ranks

WORLD = 4
SEQ, BATCH = 8, 2          # the sequence splits 4 ways under sequence parallelism
HIDDEN, FFN = 16, 24       # FFN / 4 and FFN / 2 / 4 (the stacked blocks) are whole
VOCAB, DIVISIBLE_BY = 45, 8  # padded to 48 at tp 1 and 2, 64 at tp 4: rank 3 then holds only padding
PAD_VALUE = 1e3            # in padding rows / columns: large enough to spoil any result it leaks into

# ---------------------------------------------------------------- layers


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str        # column | row | embedding | norm
    tp: int
    sp: bool
    bias: bool = True
    stack: int = 1   # column: 2 is SwiGLU's [gate; up] layout
    norm: str = "LayerNorm"

    @property
    def id(self):
        extra = {"column": f"stack{self.stack}", "row": "bias" if self.bias else "nobias", "embedding": "padded",
                 "norm": self.norm}[self.kind]
        return f"{self.kind}-{extra}-tp{self.tp}{'-sp' if self.sp else ''}"


def _build(case, ctx):
    if case.kind == "column":
        return ColumnParallelLinear(HIDDEN, FFN // case.stack, ctx, bias=case.bias, stack=case.stack)
    if case.kind == "row":
        return RowParallelLinear(FFN, HIDDEN, ctx, bias=case.bias)
    if case.kind == "embedding":
        return VocabParallelEmbedding(padded_vocab_size(VOCAB, DIVISIBLE_BY, ctx.tp_size), VOCAB, HIDDEN, ctx)
    return Norm(HIDDEN, ctx, kind=case.norm)


def _full_value(name, spec):
    """The full tensor a parameter holds in this test: random (the same for every tp, drawn from its
    name and its valid shape only), padding rows set to PAD_VALUE."""
    rows = spec.valid_rows or spec.full_shape[0]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    full = torch.full(spec.full_shape, PAD_VALUE)
    full[:rows] = torch.randn((rows, *spec.full_shape[1:]), generator=g)
    return full


@torch.no_grad()
def _load(module, ctx):
    """Give every parameter this rank's slice of its full test value (sliced here, not by the engine)."""
    for name, p in module.named_parameters():
        spec = spec_of(p)
        full = _full_value(name, spec)
        p.copy_(full if spec.tp_axis is None else full.chunk(ctx.tp_size, dim=spec.tp_axis)[ctx.tp_rank])


def _inputs(case):
    g = torch.Generator().manual_seed(5)
    if case.kind == "embedding":  # every id, the first and last, and those at the shard boundaries
        ids = torch.cat([torch.tensor([0, VOCAB - 1, 15, 16, 23, 24, 31, 32]),
                         torch.randint(0, VOCAB, (BATCH * SEQ - 8,), generator=g)])
        return ids.view(BATCH, SEQ)
    width = {"column": HIDDEN, "row": FFN, "norm": HIDDEN}[case.kind]
    return torch.randn(SEQ, BATCH, width, generator=g) + 0.5  # a mean for LayerNorm to take away


def _out_width(case):
    return FFN if case.kind == "column" else HIDDEN


def _compare(what, got, want, rtol):
    if got is None:
        return [f"{what}: no value"]
    if tuple(got.shape) != tuple(want.shape):
        return [f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"]
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    return [] if err <= rtol * scale + 1e-7 else [f"{what}: max err {err:.3g} (scale {scale:.3g})"]


def _layer_case(rank, world, case):
    ctx = build_context(world, rank, case.tp, 1, sequence_parallel=case.sp)
    try:
        i, n = ctx.tp_rank, ctx.tp_size

        def seq(t):  # this rank's part of a tensor that is whole on each rank unless the sequence is split
            return t.chunk(n, dim=0)[i] if case.sp else t

        def cols(t):  # this rank's output features of a column-parallel layer, block by block when stacked
            return t.unflatten(-1, (case.stack, -1)).chunk(n, dim=-1)[i].flatten(-2)

        def feature(t):  # this rank's input features of a row-parallel layer
            return t.chunk(n, dim=-1)[i]

        # Where each tensor lives: (local input, local output) as functions of the full ones.
        local_in, local_out = {"column": (seq, cols), "row": (feature, seq), "embedding": (lambda t: t, seq),
                               "norm": (seq, seq)}[case.kind]
        x_full = _inputs(case)
        out_grad = torch.randn(SEQ, BATCH, _out_width(case), generator=torch.Generator().manual_seed(6))

        ref = _build(case, ParallelContext())
        _load(ref, ParallelContext())
        float_input = x_full.is_floating_point()
        x_ref = x_full.clone().requires_grad_(float_input)
        y_ref = ref(x_ref)
        y_ref.backward(out_grad)

        layer = _build(case, ctx)
        _load(layer, ctx)
        x = local_in(x_full).clone().requires_grad_(float_input)
        y = layer(x)
        y.backward(local_out(out_grad).clone())

        failures = _compare("forward", y.detach(), local_out(y_ref.detach()), 1e-5)
        if float_input:
            failures += _compare("input grad", x.grad, local_in(x_ref.grad), 1e-5)
        ref_params = dict(ref.named_parameters())
        if set(ref_params) != {name for name, _ in layer.named_parameters()}:
            return failures + [f"parameters {sorted(ref_params)} at tp 1, others at tp {n}"]
        for name, p in layer.named_parameters():
            spec = spec_of(p)
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if spec.valid_rows is not None and spec.tp_axis == 0:
                # The padding rows this rank holds are never looked up: their gradient must be exactly 0.
                pad = torch.arange(p.shape[0]) + i * p.shape[0] >= spec.valid_rows
                if g[pad].any():
                    failures.append(f"grad {name}: nonzero on vocabulary padding")
            if spec.sp_partial_grad and ctx.sequence_parallel:
                dist.all_reduce(g, group=ctx.tp_group)  # each rank's covers its sequence slice only
            want = full_grad(ref_params[name], ParallelContext(), ref_params[name].grad)
            failures += _compare(f"grad {name}", full_grad(p, ctx, g), want, 1e-5)
        return failures
    finally:
        ctx.destroy()


LAYER_CASES = [Case("column", tp, sp, stack=stack) for stack in (1, 2) for tp in (2, 4) for sp in (False, True)] + \
              [Case("row", tp, sp, bias=bias) for bias in (True, False) for tp in (2, 4) for sp in (False, True)] + \
              [Case("embedding", tp, sp) for tp in (2, 4) for sp in (False, True)] + \
              [Case("norm", tp, sp, norm=norm) for norm in ("LayerNorm", "RMSNorm") for tp in (2, 4)
               for sp in (False, True)]


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c.id for c in LAYER_CASES])
def test_layer_matches_tp1(case):
    results = run_ranks(_layer_case, WORLD, case)
    assert all(r == [] for r in results), "\n".join(f"rank {i}: {f}" for i, r in enumerate(results) for f in r)


# ---------------------------------------------------------------- init_weights

INIT_CASES = [Case("column", 0, False, stack=1), Case("column", 0, False, stack=2), Case("row", 0, False),
              Case("embedding", 0, False)]


@pytest.mark.parametrize("tp", (2, 4), ids=["tp2", "tp4"])
@pytest.mark.parametrize("case", INIT_CASES, ids=[c.id.rsplit("-", 1)[0] for c in INIT_CASES])
def test_init_weights_slices_the_tp1_tensors(case, tp):
    # Only each rank's tp_size and tp_rank matter to the layers, so virtual contexts stand in for ranks.
    ref = _build(case, ParallelContext())
    init_weights(ref, ParallelContext(), seed=9)
    shards = []
    for r in range(tp):
        ctx = ParallelContext.virtual(tp=tp, tp_rank=r)
        layer = _build(case, ctx)
        init_weights(layer, ctx, seed=9)
        shards.append(dict(layer.named_parameters()))
    for name, p in ref.named_parameters():
        spec = spec_of(shards[0][name])
        parts = [s[name].detach() for s in shards]
        full = torch.cat(parts, dim=spec.tp_axis) if spec.tp_axis is not None else parts[0]
        if spec.tp_axis is None:
            assert all(torch.equal(t, parts[0]) for t in parts), f"{name}: replicas differ"
        rows = spec.valid_rows or full.shape[0]
        assert torch.equal(full[:rows], p.detach()[:rows]), f"{name}: not the tp-1 tensor"
        assert not full[rows:].any(), f"{name}: vocabulary padding is not zero"
    if case.kind == "column":  # the draw is random, not all zeros: the comparison above means something
        assert ref.weight.std().item() > 0.01


# ---------------------------------------------------------------- vocabulary-parallel cross-entropy

TOKENS = 12


def _ce_data(padded):
    """Logits [TOKENS, padded] whose padding columns would dominate any softmax they leaked into,
    targets that include both ends of the vocabulary and shard boundaries, and a per-token gradient."""
    g = torch.Generator().manual_seed(8)
    logits = torch.full((TOKENS, padded), PAD_VALUE)
    logits[:, :VOCAB] = 3.0 * torch.randn(TOKENS, VOCAB, generator=g)
    target = torch.cat([torch.tensor([0, VOCAB - 1, 15, 16, 23, 24, 31, 32]),
                        torch.randint(0, VOCAB, (TOKENS - 8,), generator=g)])
    return logits, target, torch.rand(TOKENS, generator=g) + 0.5


def _ce_reference(logits, target, loss_grad, z):
    """Loss and logit gradient from torch.nn.functional on the valid columns."""
    x = logits[:, :VOCAB].clone().requires_grad_()
    loss = F.cross_entropy(x, target, reduction="none") + z * torch.logsumexp(x, dim=-1) ** 2
    loss.backward(loss_grad)
    return loss.detach(), x.grad


def _ce_failures(loss, grad_full, logits, target, loss_grad, z):
    want_loss, want_grad = _ce_reference(logits, target, loss_grad, z)
    failures = _compare("loss", loss.detach(), want_loss, 1e-5)
    failures += _compare("logit grad", grad_full[:, :VOCAB], want_grad, 1e-5)
    if grad_full[:, VOCAB:].any():
        failures.append("logit grad: nonzero on vocabulary padding")
    return failures


def _ce_case(rank, world, tp, z):
    ctx = build_context(world, rank, tp, 1)
    try:
        logits, target, loss_grad = _ce_data(padded_vocab_size(VOCAB, DIVISIBLE_BY, tp))
        leaf = logits.chunk(tp, dim=1)[ctx.tp_rank].clone().requires_grad_()
        # A copy goes in: the op writes its gradient over the logits it saved.
        loss = vocab_parallel_cross_entropy(leaf.clone(), target, ctx, VOCAB, z_loss_weight=z)
        loss.backward(loss_grad)
        parts = [torch.empty_like(leaf.grad) for _ in range(tp)]
        dist.all_gather(parts, leaf.grad, group=ctx.tp_group)
        return _ce_failures(loss, torch.cat(parts, dim=1), logits, target, loss_grad, z)
    finally:
        ctx.destroy()


CE_CASES = [(tp, z) for tp in (2, 4) for z in (0.0, 0.05)]


@pytest.mark.parametrize("tp,z", CE_CASES, ids=[f"tp{tp}{'-zloss' if z else ''}" for tp, z in CE_CASES])
def test_vocab_parallel_cross_entropy_matches_torch(tp, z):
    results = run_ranks(_ce_case, WORLD, tp, z)
    assert all(r == [] for r in results), "\n".join(f"rank {i}: {f}" for i, r in enumerate(results) for f in r)


@pytest.mark.parametrize("z", (0.0, 0.05), ids=["tp1", "tp1-zloss"])
def test_cross_entropy_tp1_matches_torch(z):
    # One process, no group: the padded columns are still left out.
    logits, target, loss_grad = _ce_data(padded_vocab_size(VOCAB, DIVISIBLE_BY, 1))
    leaf = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf.clone(), target, ParallelContext(), VOCAB, z_loss_weight=z)
    loss.backward(loss_grad)
    assert _ce_failures(loss, leaf.grad, logits, target, loss_grad, z) == []


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_add_is_the_residual_add_then_the_norm(kind):
    """Norm.add (the fused residual add + norm the decoder layer uses) against the two steps it replaces."""
    norm = Norm(8, ParallelContext(), kind, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if norm.bias is not None:
            norm.bias.uniform_(-0.5, 0.5)
    g = torch.Generator().manual_seed(3)
    x, r, dy, ds = (torch.randn(4, 2, 8, generator=g) for _ in range(4))
    outs, grads = [], []
    for fused in (True, False):
        xi, ri = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, s = norm.add(xi, ri) if fused else (norm(xi + ri), xi + ri)
        norm.zero_grad()
        torch.autograd.backward([y, s], [dy, ds])
        outs.append((y.detach(), s.detach()))
        grads.append([xi.grad, ri.grad] + [p.grad.clone() for p in norm.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*grads))

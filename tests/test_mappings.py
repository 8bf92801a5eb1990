"""The tensor-parallel communication ops of engine/parallel/mappings.py, one at a time (fp32, CPU, gloo).

For each op and for `enter_tp` / `exit_tp` under both settings of `sequence_parallel`, the forward value
and the gradient it passes back are compared with the same collective written out on one process:
every rank draws every rank's input and output gradient, so it can compute what a correct op must give
it. Inputs and gradients differ per rank, so an op that reduces where it should copy, gathers in the
wrong order or along the wrong dim, or skips its backward collective cannot pass by symmetry. A group of
size 1 (a real one, and `None`) must make every op the identity both ways.

Budget: about 10 s alone on a 2-core machine, half of it starting the pool of 4 ranks (tp 4, and tp 2 x
dp 2) that test_layers.py and the other parallel tests reuse; each case then takes about 0.1 s.
"""
import pytest
import torch

from engine.layout import Layout
from engine.parallel import mappings
from engine.parallel.topology import ParallelContext, build_context
from harness import run_ranks

WORLD = 4
SEQ, BATCH, HIDDEN = 3, 2, 5  # one rank's sequence slice [s, b, h]; batch > 1 so a dim-1 collective shows

OPS = {
    "copy_to_tp": mappings.copy_to_tp,
    "reduce_from_tp": mappings.reduce_from_tp,
    "gather_from_sp": mappings.gather_from_sp,
    "reduce_scatter_to_sp": mappings.reduce_scatter_to_sp,
}
# What enter_tp / exit_tp must amount to, by sequence_parallel.
CONTEXT_OPS = {("enter_tp", False): "copy_to_tp", ("enter_tp", True): "gather_from_sp",
               ("exit_tp", False): "reduce_from_tp", ("exit_tp", True): "reduce_scatter_to_sp"}


def _shapes(op, tp):
    """(input shape, output-gradient shape) on one rank."""
    slice_, full = (SEQ, BATCH, HIDDEN), (SEQ * tp, BATCH, HIDDEN)
    return {"copy_to_tp": (full, full), "reduce_from_tp": (full, full),
            "gather_from_sp": (slice_, full), "reduce_scatter_to_sp": (full, slice_)}[op]


def _expected(op, xs, gs, i):
    """The forward value and input gradient of rank `i` of a group whose inputs are `xs` and output
    gradients `gs` (in group order), computed in float64 without any communication."""
    n = len(xs)
    if op == "copy_to_tp":  # forward: identity; backward: sum over the group
        return xs[i], sum(gs)
    if op == "reduce_from_tp":  # forward: sum over the group; backward: identity
        return sum(xs), gs[i]
    if op == "gather_from_sp":  # forward: concatenate along the sequence; backward: sum, keep own slice
        return torch.cat(xs), sum(gs).chunk(n)[i]
    if op == "reduce_scatter_to_sp":  # forward: sum, keep own slice; backward: concatenate
        return sum(xs).chunk(n)[i], torch.cat(gs)
    raise ValueError(op)


def _per_rank(seed, shape):
    """A distinct tensor for each global rank, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((WORLD, *shape), generator=g)


def _compare(what, got, want, rtol):
    if got is None:
        return [f"{what}: no value"]
    if tuple(got.shape) != tuple(want.shape):
        return [f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"]
    err = (got.double() - want.double()).abs().max().item()
    scale = want.abs().max().item()
    return [] if err <= rtol * scale else [f"{what}: max err {err:.3g} (scale {scale:.3g})"]


def _apply(op, x, ctx):
    if op in OPS:
        return OPS[op](x, ctx.tp_group)
    return getattr(mappings, op)(x, ctx)


def _op_case(rank, world, op, tp, sp):
    ctx = build_context(world, rank, tp, 1, sequence_parallel=sp)
    try:
        meaning = CONTEXT_OPS.get((op, sp), op)
        x_shape, g_shape = _shapes(meaning, tp)
        xs, gs = _per_rank(1, x_shape), _per_rank(2, g_shape)
        members = ctx.tp_ranks  # global ranks of this TP group, in group order
        want_y, want_dx = _expected(meaning, [xs[r].double() for r in members], [gs[r].double() for r in members],
                                    members.index(rank))
        x = xs[rank].clone().requires_grad_()
        y = _apply(op, x, ctx)
        y.backward(gs[rank].clone())
        return _compare("forward", y.detach(), want_y, 1e-6) + _compare("backward", x.grad, want_dx, 1e-6)
    finally:
        ctx.destroy()


CASES = [(op, tp, False) for op in OPS for tp in (2, 4)] + \
        [(op, tp, sp) for op in ("enter_tp", "exit_tp") for sp in (False, True) for tp in (2, 4)]


@pytest.mark.parametrize("op,tp,sp", CASES, ids=[f"{op}{'-sp' if sp else ''}-tp{tp}" for op, tp, sp in CASES])
def test_op_forward_and_backward_match_one_process(op, tp, sp):
    # tp 2 runs as two groups of 2 (dp 2): each group must reduce over its own members only.
    results = run_ranks(_op_case, WORLD, op, tp, sp)
    assert all(r == [] for r in results), "\n".join(f"rank {i}: {f}" for i, r in enumerate(results) for f in r)


# ---------------------------------------------------------------- a group of one: every op is the identity

ALL_OPS = list(OPS) + ["enter_tp", "exit_tp"]


def _identity_failures(op, ctx):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    leaf = x.clone().requires_grad_()
    y = _apply(op, leaf, ctx)
    y.backward(g.clone())
    failures = []
    if not torch.equal(y.detach(), x):
        failures.append("forward is not the identity")
    if leaf.grad is None or not torch.equal(leaf.grad, g):
        failures.append("backward is not the identity")
    return failures


def _identity_case(rank, world, op, sp):
    # tp 1 on 4 ranks: each rank's TP group is a real process group holding only itself. The context
    # turns sequence parallelism off at tp 1, so `sp` only matters for the explicit ops.
    ctx = build_context(world, rank, 1, 1, sequence_parallel=sp)
    try:
        return _identity_failures(op, ctx)
    finally:
        ctx.destroy()


@pytest.mark.parametrize("op", ALL_OPS, ids=[f"{op}-tp1" for op in ALL_OPS])
def test_group_of_one_is_identity(op):
    results = run_ranks(_identity_case, WORLD, op, True)
    assert all(r == [] for r in results), results


IDENTITY_NONE = [(op, False) for op in ALL_OPS] + [(op, True) for op in ("enter_tp", "exit_tp")]


@pytest.mark.parametrize("op,sp", IDENTITY_NONE,
                         ids=[f"{op}{'-sp' if sp else ''}-none" for op, sp in IDENTITY_NONE])
def test_group_none_is_identity(op, sp):
    # No process group at all (one process, no torch.distributed): what a single-device run uses. A
    # context that asks for sequence parallelism (a layout of tp 2) without a group must still not communicate.
    ctx = ParallelContext(layout=Layout(tp=2, sequence_parallel=sp))
    assert ctx.sequence_parallel == sp
    assert _identity_failures(op, ctx) == []


def _shared_gradient(rank, world):
    """x feeds copy_to_tp and, through the same intermediate, a plain branch: the plain branch's gradient
    must stay one per element, whatever copy_to_tp's backward all-reduce does with the tensor it is given."""
    ctx = build_context(world, rank, world, 1)
    x = torch.ones(3, requires_grad=True)
    h = x * 1.0
    (h + mappings.copy_to_tp(h, ctx.tp_group)).backward(torch.ones(3))
    inputs = torch.full((3,), float(rank + 1))
    summed = mappings.reduce_from_tp(inputs, ctx.tp_group)
    ctx.destroy()
    return x.grad.tolist(), inputs.tolist(), summed.tolist()


def test_ops_never_change_a_tensor_someone_else_holds():
    for rank, (grad, inputs, summed) in enumerate(run_ranks(_shared_gradient, 2)):
        assert grad == [3.0] * 3, "1 from the plain branch + 2 (all-reduced over tp 2) from copy_to_tp"
        assert inputs == [rank + 1.0] * 3 and summed == [3.0] * 3, "reduce_from_tp summed its input in place"

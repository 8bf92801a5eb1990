"""engine/qkv.py: the fused QKV output split into q, k, v gives indexing's values and gradients bit for bit, and its
backward writes the whole gradient once (one concatenation) where indexing's filled, copied and added three times."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.qkv import split_qkv

S, B, GROUPS, PER_GROUP, HEAD_DIM = 5, 3, 2, 4, 8


def _by_indexing(qkv):
    whole = qkv.view(S, B, GROUPS, PER_GROUP + 2, HEAD_DIM)
    return whole[..., :PER_GROUP, :].reshape(S, B, -1, HEAD_DIM), whole[..., PER_GROUP, :], whole[..., PER_GROUP + 1, :]


class _Ops(TorchDispatchMode):
    """The aten operators run, with their outputs' element counts."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ran.append((func.overloadpacket.__name__, out.numel() if isinstance(out, torch.Tensor) else 0))
        return out


def _backward_ops(split, qkv, grads):
    outs = split(qkv)
    with _Ops() as ops:
        torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])
    return ops.ran


def test_values_and_gradients_equal_indexings_and_the_gradient_is_written_once():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(S, B, GROUPS * (PER_GROUP + 2) * HEAD_DIM, generator=g)
    ours, theirs = data.clone().requires_grad_(), data.clone().requires_grad_()
    mine = split_qkv(ours, GROUPS, PER_GROUP, HEAD_DIM)
    assert all(t.is_contiguous() for t in mine)  # tensors of their own: no view keeps the whole output alive
    for a, b in zip(mine, _by_indexing(theirs)):
        assert torch.equal(a, b)
    grads = [torch.randn(t.shape, generator=g) for t in mine]
    ran = _backward_ops(lambda x: split_qkv(x, GROUPS, PER_GROUP, HEAD_DIM), ours, grads)
    indexing = _backward_ops(_by_indexing, theirs, grads)
    assert torch.equal(ours.grad, theirs.grad)
    whole, views = data.numel(), ("view", "_unsafe_view", "detach", "alias")
    assert [op for op, n in ran if n == whole and op not in views] == ["cat"]  # one write of the whole gradient
    wasteful = [op for op, n in indexing if n == whole and op not in views]
    assert len(wasteful) >= 5 and "add" in wasteful, wasteful  # what it replaces: zero fills, copies and adds


def test_a_piece_without_gradient_gets_zeros():
    qkv = torch.randn(S, B, GROUPS * (PER_GROUP + 2) * HEAD_DIM, requires_grad=True)
    q, k, v = split_qkv(qkv, GROUPS, PER_GROUP, HEAD_DIM)
    (q.sum() + 2 * k.sum()).backward()  # v unused
    whole = qkv.grad.view(S, B, GROUPS, PER_GROUP + 2, HEAD_DIM)
    assert torch.equal(whole[..., :PER_GROUP, :], torch.ones_like(whole[..., :PER_GROUP, :]))
    assert torch.equal(whole[..., PER_GROUP, :], torch.full_like(whole[..., PER_GROUP, :], 2.0))
    assert not whole[..., PER_GROUP + 1, :].any()

"""Point-to-point traffic between pipeline stages: fixed shapes, non-blocking sends, tagged messages.

Every message between stages has one precomputed shape ([s, b, h], or [s/tp, b, h] under sequence
parallelism), so receivers allocate without a handshake. Sends are non-blocking and only receives
wait, which keeps any deadlock-free schedule deadlock-free whatever the backend buffers. Activations
(flowing to later stages) and gradients (flowing back) use separate groups and tags, so the two
streams can never be confused, even at pp 2 where a rank's next and previous stage are the same rank
(nccl ignores tags and matches messages in order per group; gloo matches by tag).

Once a send has completed, the sent activation's storage is released: backward needs only its
autograd graph, not its values (see `release`).
"""
from __future__ import annotations

import torch

from engine import comm


def _tag(chunk: int, microbatch: int, vpp: int) -> int:
    return microbatch * vpp + chunk


class StageLink:
    def __init__(self, ctx, shape, dtype, device):
        self.ctx, self.shape, self.dtype, self.device = ctx, tuple(shape), dtype, device
        self.pending = []  # (work, tensor or None to release afterwards)

    def send_activation(self, t, chunk, mb):
        """Output of (chunk, mb) to the stage holding the next virtual stage."""
        work = comm.isend(t.detach(), self.ctx.next_rank, self.ctx.pp_group, _tag(chunk, mb, self.ctx.vpp_size))
        self.pending.append((work, t))

    def recv_activation(self, chunk, mb):
        """Input of (chunk, mb) from the stage holding the previous virtual stage."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        prev_chunk = chunk if self.ctx.pp_rank > 0 else chunk - 1
        comm.irecv(buf, self.ctx.prev_rank, self.ctx.pp_group, _tag(prev_chunk, mb, self.ctx.vpp_size)).wait()
        return buf.requires_grad_()

    def send_grad(self, g, chunk, mb):
        """Gradient of the input of (chunk, mb) back to the stage that produced it."""
        work = comm.isend(g, self.ctx.prev_rank, self.ctx.pp_grad_group, _tag(chunk, mb, self.ctx.vpp_size))
        self.pending.append((work, None))

    def recv_grad(self, chunk, mb):
        """Gradient of the output of (chunk, mb) from the next virtual stage."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        next_chunk = chunk if self.ctx.pp_rank < self.ctx.pp_size - 1 else chunk + 1
        comm.irecv(buf, self.ctx.next_rank, self.ctx.pp_grad_group, _tag(next_chunk, mb, self.ctx.vpp_size)).wait()
        return buf

    def reap(self, wait: bool = False) -> None:
        """Forget completed sends, releasing the activations they carried."""
        still = []
        for work, t in self.pending:
            if wait:
                work.wait()
            if wait or work.is_completed():
                if t is not None:
                    release(t)
            else:
                still.append((work, t))
        self.pending = still


def release(t: torch.Tensor) -> None:
    """Drop a tensor's values but keep its autograd graph (backward of the residual add needs none)."""
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from an output whose storage may have been released (shapes are not re-checked)."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)

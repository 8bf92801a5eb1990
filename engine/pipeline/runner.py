"""Executing this rank's pipeline schedule with real tensors: forwards, backwards and the exchanges between.

`PipelineRunner` is built once per run (this rank's model chunks, the message shape and dtype, an
optional trace) and `run(microbatches)` does one step's forward and backward passes over all of them,
in the order `schedules.schedule_steps` gives, with one batched exchange between consecutive steps
(`p2p.exchange_plan`). With pp 1 it is plain gradient accumulation.

Under a zero-bubble schedule a chunk's forward and its B run under `weight_grad_store.deferring_weight_grads`
with one store per (chunk, microbatch), so B computes input gradients only; its W operation computes
the weight gradients from that store (`weight_grad_store.weight_grads`).

With packed documents (--reset-attention-mask) a training run also counts the attention pairs its microbatches'
documents hold (`attention_pairs`: what engine.flops counts for them), for the step's FLOPs and MFU.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch

from engine import fp8, mtp
from engine.documents import Packing
from engine.flops import UNIT, Costs, attention_pairs, split_backward_costs
from engine.loss import microbatch_loss, step_loss, token_count
from engine.parallel import comm, weight_grad_store
from engine.parallel.context_split import shard_batch
from engine.pipeline.p2p import StageLink, backward_through, exchange_plan, messages
from engine.pipeline.schedules import check_schedule, schedule_steps


class PipelineRunner:
    def __init__(self, chunks: list, ctx, shape: tuple, dtype, device, trace=None, costs: Costs = UNIT,
                 packing: Packing = Packing()):
        """`shape`: every message between stages (ctx.activation_shape); `trace`: a PipelineTrace or None;
        `costs`: a stage's forward, B and W, which a zero-bubble order is built for (engine.flops.
        split_backward_costs); `packing`: the run's packed-document rule, read at the door. The schedule is the
        context's (ctx.layout.schedule)."""
        self.chunks, self.ctx, self.device, self.trace, self.costs = chunks, ctx, device, trace, costs
        self.packing = packing
        self.attention_pairs: Optional[int] = None  # the last training run's, with packed documents
        self.schedule = ctx.layout.schedule
        self.link = StageLink(ctx, shape, dtype, device)
        self.deferred: dict = {}  # (chunk, microbatch) -> the weight-gradient work its W will do
        self.loss_rank = self.schedule.loss_rank
        self.fp8 = fp8.keepers(chunks)  # the FP8 linears and experts whose weights a schedule quantizes once

    @classmethod
    def from_config(cls, cfg, chunks: list, ctx, dtype, device, trace=None) -> "PipelineRunner":
        """The runner of a training run: messages of the configured microbatch, and a zero-bubble order built for
        the model's FLOPs split of the backward (engine.flops)."""
        m = cfg.model
        shape = ctx.activation_shape(m.seq_length, cfg.training.micro_batch_size, m.hidden_size)
        costs = split_backward_costs(m, m.seq_length, m.recompute_granularity)
        return cls(chunks, ctx, shape, dtype, device, trace, costs, Packing.of(cfg))

    def run(self, microbatches: list, scale_loss: Optional[Callable] = None, forward_only: bool = False,
            shared: bool = True):
        """Forward (and backward) over all microbatches; returns the mean loss, known on every rank, or with
        `shared` False without any collective: this rank's share of it (`loss_share`).

        `microbatches`: dicts (tokens, labels, loss_mask) of whole sequences; every rank gets the same list and
        cuts it here, once, to its positions (engine.parallel.context_split.shard_batch); only the first stage
        reads tokens and only the last labels. Losses fed to backward are divided by the number of
        microbatches (engine.loss); `scale_loss` (fp16 loss scaling, fault drills) applies after that,
        and to the MoE balancing losses' gradients alike.
        """
        ctx, m, schedule = self.ctx, len(microbatches), self.schedule
        check_schedule(schedule, m)
        microbatches = [self._at_the_door(batch) for batch in microbatches]
        if not forward_only:
            self.attention_pairs = self._pairs(microbatches)
            unit = torch.ones((), dtype=torch.float64)  # (float64: a static --loss-scale as given)
            aux_scale = float(scale_loss(unit) if scale_loss is not None else unit) / m
            for chunk in self.chunks:
                chunk.set_aux_loss_scale(aux_scale)
        steps = schedule_steps(schedule, ctx.pp_rank, m, forward_only, self.costs)
        saved, losses, outbox = {}, [], {}
        with fp8.weights_held(self.fp8, m):  # the weights stay as they are until the schedule ends
            for exchange, ops in exchange_plan(steps, schedule, ctx.pp_rank, self.costs):
                # what earlier steps made for this batch to send, what this step needs (one entry per operation)
                inbox = self.link.exchange(exchange, [outbox.pop(msg[1:]) for msg in exchange.sends])
                for (kind, chunk, mb), received in zip(ops, inbox):
                    start = time.time()  # inputs have arrived: waiting for them shows as idle time in the trace
                    made = self._run_op(kind, chunk, mb, microbatches, received, saved, scale_loss, losses,
                                        forward_only)
                    send = messages(kind, chunk, mb, ctx.pp_rank, schedule)[1]
                    if send is not None:
                        outbox[send[1:]] = made
                    if self.trace is not None and not forward_only:  # evaluation passes are not traced
                        self.trace.record(kind, mb, chunk, start, time.time())
        return self._share_loss(losses) if shared else self.loss_share(losses)

    def _at_the_door(self, batch: dict) -> dict:
        """This rank's part of a microbatch of whole sequences, with its token count and, for a model with
        multi-token prediction, its targets (engine.mtp.targets: from the whole sequences, then cut)."""
        depth = self.chunks[0].cfg.mtp_num_layers
        extra = mtp.targets(batch, depth) if depth and batch.get("labels") is not None else {}
        mine = shard_batch(batch | extra, self.ctx, self.packing)
        return dict(mine, count=token_count(batch), mtp=None if not extra else
                    {k: mine[k] for k in mtp.KEYS} | {"mtp_count": extra["mtp_count"]})

    def _pairs(self, microbatches: list) -> Optional[int]:
        """The attention pairs engine.flops counts for the microbatches' packed documents, summed over their
        samples and the model's layers; None where attention covers whole samples (the formula's count)."""
        if not self.packing.reset_attention_mask:
            return None
        model = self.chunks[0].cfg
        return sum(attention_pairs(model, lengths) for mb in microbatches for lengths in mb["documents"].lengths())

    def _run_op(self, kind, chunk, mb, microbatches, received, saved, scale_loss, losses, forward_only):
        """One operation; returns what it sends on (a forward's output, a B's input gradient) or None."""
        if kind == "F":
            with self._deferring(chunk, mb, forward_only):
                x, out = self._forward(chunk, microbatches[mb], received, len(microbatches), scale_loss, losses)
            if not forward_only:
                saved[(chunk, mb)] = (x, out)
            return out
        if kind == "B":
            with self._deferring(chunk, mb, forward_only):  # forwards recomputed inside B defer too
                return self._backward(*saved.pop((chunk, mb)), received)
        weight_grad_store.weight_grads(self.deferred.pop((chunk, mb)))
        return None

    def _deferring(self, chunk: int, mb: int, forward_only: bool):
        """Where this chunk's weight gradients go for this microbatch: the store of its W, under a zero-bubble
        schedule; nowhere else (computed in backward as usual)."""
        if not self.schedule.split_backward or forward_only:
            return contextlib.nullcontext()
        return weight_grad_store.deferring_weight_grads(self.deferred.setdefault((chunk, mb), []))

    def _forward(self, chunk: int, batch: dict, received, m: int, scale_loss, losses: list) -> tuple:
        """(input, output) of one chunk's forward; on the last stage the output is the scaled loss."""
        model = self.chunks[chunk]
        x = None if received is None else received.requires_grad_()
        out = model(tokens=batch["tokens"], hidden=x, labels=batch.get("labels"), positions=batch["positions"],
                    position_ids=batch["position_ids"], documents=batch["documents"], mtp=batch["mtp"])
        if model.post_process:
            out = microbatch_loss(out, batch.get("loss_mask"), batch["count"])
            losses.append(out.detach())
            out = out / m
            if scale_loss is not None:
                out = scale_loss(out)
        return x, out

    @staticmethod
    def _backward(x, out, received):
        """Backward of one chunk; returns the gradient of its input (None on the first stage)."""
        if received is None:
            out.backward()
        else:
            backward_through(out, received)
        return None if x is None else x.grad

    def loss_share(self, losses: list) -> torch.Tensor:
        """This rank's share of the mean loss: the sum of every rank's shares is what `_share_loss` gives (the
        loss rank's TP rank 0 holds the mean over its microbatches, over dp replicas averaged, CP shares
        summed; every other rank holds 0). Post-validation sums it with the gradient norm in one all-reduce."""
        ctx = self.ctx
        if ctx.pp_rank != self.loss_rank or ctx.tp_rank != 0:
            return torch.zeros((), device=self.device)
        return step_loss(losses, ctx.dp_size, self.device)

    def _share_loss(self, losses: list) -> float:
        """The step's loss from the loss's rank to every rank: the shares summed over CP ranks and dp replicas
        (engine.loss.step_loss)."""
        ctx = self.ctx
        value = step_loss(losses, ctx.dp_size, self.device).reshape(1).clone()
        if ctx.pp_size > 1:
            comm.broadcast(value, ctx.pp_ranks[self.loss_rank], ctx.pp_group)
        if ctx.dp_cp_size > 1:
            comm.all_reduce(value, ctx.dp_cp_group)
        return value.item()

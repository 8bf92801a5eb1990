"""Mixed-precision AdamW (or Muon for the hidden matrices) over the grad buffer, replicated or sharded over dp
(ZeRO-1, -2, -3).

Each trainable parameter has an entry: the flat range [start, end) of its elements this rank updates
(all of them, or its shard under the distributed optimizer), an fp32 master copy of that range and the
matching slice of its fp32 main grad. In fp32 without sharding the master is the parameter itself.
A step: global grad norm -> skip on inf/nan (loss scaler updated) -> unscale and clip in one
multiply -> AdamW on the masters -> masters copied into the model's parameters, all-gathered over dp
per bucket when sharded.

Optimizer state is kept per parameter name: `state_dict()["params"][name]` holds `range`, `numel`,
`exp_avg`, `exp_avg_sq` (Adam's; `momentum` instead for a matrix Muon takes) and, where the master is not the
parameter itself, `master`, all flat fp32 tensors over `range`; `state_dict()["optimizer"]` says whose state
it is (adam or muon). `load_state_dict` accepts either the same ranges or whole tensors (range [0, numel]),
which is what a checkpoint resharded over dp provides.

`--optimizer muon` (engine/optim/muon.py) takes the entries of the hidden weight matrices (every range the
same as AdamW's, so sharding and checkpoints are unchanged); AdamW keeps the rest. The step then runs AdamW,
then Muon, on the same clipped gradients.

The data-parallel sharding strategy (Megatron-FSDP's names) decides what is sharded over the dp x cp
replicas: `no_shard` nothing; `optim` (ZeRO-1) the masters and Adam state; `optim_grads` (ZeRO-2) the
gradients too, which the grad buffer reduce-scatters per microbatch instead of keeping whole; and
`optim_grads_params` (ZeRO-3) the weights too (param_shard.py): the masters then update the weights'
shards directly and nothing is all-gathered after the step. Under ZeRO-1/2 `--overlap-param-gather` leaves the
step's all-gathers in flight, each bucket waited for by the forward that first needs it (param_gather.py).
With `--fp8-param-gather` (ZeRO-1/2) the buckets holding FP8 weights (the FP8 linears' and the routed experts')
move those as FP8 codes (fp8_gather.py); the weights' other replicas' elements are then gathered in the run's
precision only when read outside forward (wait_weights, full_weights). Under ZeRO-3 the unit gathers move them
as codes (fp8_shard.py) and full_weights gathers the shards in the run's precision.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from engine.optim import adamw
from engine.optim.clip import clip_coefficient, counts_toward_norm, global_grad_norm
from engine.optim.fp8_codes import fp8_weights
from engine.optim.fp8_gather import Fp8Gather
from engine.optim.fp8_shard import Fp8Shard
from engine.optim.grad_buffer import DEFAULT_BUCKET_NUMEL, GradBuffer
from engine.optim.loss_scaler import LossScaler
from engine.optim.muon import Muon, classify
from engine.optim.newton_schulz import MuonSettings
from engine.optim.param_gather import ParamGather
from engine.optim.param_shard import ParamSharder, param_units
from engine.parallel import comm
from engine.parallel.layers import is_vocabulary_table


@dataclass
class StepResult:
    updated: bool      # False when the step was skipped for inf/nan gradients
    grad_norm: float   # global L2 norm before clipping, loss scale removed
    loss_scale: float  # the scale the next step's loss is multiplied by


@dataclass
class _Entry:
    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    master: torch.Tensor
    owns_master: bool
    buffer: GradBuffer


def param_names(model_chunks: list) -> dict:
    """id(param) -> its name in its chunk (the model names layers by global id, so chunks do not clash)."""
    names, taken = {}, set()
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            if id(p) in names:
                continue
            if name in taken:
                raise ValueError(f"parameter name {name!r} appears in two model chunks; names must be unique per rank")
            names[id(p)] = name
            taken.add(name)
    return names


class Optimizer:
    def __init__(self, cfg, model_chunks: list, ctx, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        """What is sharded over the replicas is the context's layout's (ctx.layout.sharding)."""
        par, opt = cfg.parallel, cfg.optim
        self.ctx = ctx
        sharding = ctx.layout.sharding
        self.distributed = sharding.optimizer
        self.clip_grad = opt.clip_grad
        self.scaler = LossScaler.from_config(cfg.training)
        units = param_units(model_chunks) if sharding.params else None
        # Dense parameters reduce (and shard) over dp x cp; MoE experts over their own replicas (engine.moe).
        kw = dict(distributed=self.distributed, overlap=par.overlap_grad_reduce, bucket_numel=bucket_numel,
                  shard_grads=sharding.grads,
                  units=[u.params for chunk in units for u in chunk] if units else None,
                  fuse=cfg.training.gradient_accumulation_fusion)
        self.buffer = GradBuffer(model_chunks, ctx, **kw)
        self.expert_buffer = GradBuffer(model_chunks, ctx, experts=True, **kw)
        self.buffers = [b for b in (self.buffer, self.expert_buffer) if b.params or b is self.buffer]
        self.sharder = ParamSharder(model_chunks, units, self.buffers, prefetch=par.overlap_param_gather) \
            if units else None
        if self.sharder is not None and cfg.training.fp8_param_gather:  # ZeRO-3: unit gathers move FP8 codes
            self.sharder.fp8 = Fp8Shard(self.sharder.slots, fp8_weights(model_chunks))
        # ZeRO-1/2 with --fp8-param-gather: FP8 weights (linears', experts') gathered as FP8 codes
        self.fp8 = Fp8Gather(self.buffers, fp8_weights(model_chunks), ctx) \
            if self.distributed and units is None and cfg.training.fp8_param_gather else None
        # ZeRO-1/2 with --overlap-param-gather: the weights become views of flat buckets before the entries are made
        self.gather = ParamGather(model_chunks, self.buffers, self.fp8) \
            if self.distributed and units is None and par.overlap_param_gather else None
        self.steps = 0
        self.name = opt.optimizer  # what the checkpoint's optimizer state is (checked on load)
        self._entries = self._make_entries(param_names(model_chunks))
        self._in_bucket = self._entries_by_bucket()
        # --optimizer muon: Muon takes the hidden matrices (muon.classify), AdamW the rest.
        takes = {id(e) for e in self._entries if opt.optimizer == "muon" and not classify(e.name, e.param)}
        scalar = [e for e in self._entries if id(e) not in takes]
        # --decoupled-lr: the vocabulary tables in a group of their own, which update() gives StepLR.decoupled
        own = [e for e in scalar if opt.decoupled_lr is not None and is_vocabulary_table(e.param)]
        scalar = [e for e in scalar if not any(e is d for d in own)]
        groups = [dict(params=[e.master for e in scalar if e.param.ndim >= 2], weight_decay=opt.weight_decay),
                  dict(params=[e.master for e in scalar if e.param.ndim < 2], weight_decay=0.0),
                  dict(params=[e.master for e in own], weight_decay=opt.weight_decay, decoupled=True)]
        groups = [g for g in groups if g["params"]]
        # A dp rank can own no element at all of a tiny model; it still joins every collective.
        self.adam = adamw.make_adamw(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                     device=self.buffer.data.device) if groups else None
        self.muon = Muon(MuonSettings.of(opt), [e for e in self._entries if id(e) in takes], self.buffers, ctx) \
            if opt.optimizer == "muon" else None  # on every rank: its plans' exchanges are collective
        self._muon_entries = takes
        self._gather_out = {}

    def _make_entries(self, names: dict) -> list:
        entries = []
        for buffer in self.buffers:
            for p in buffer.params:
                r = buffer.local_range(p)
                if r is None:
                    continue
                values = self._values(p, r)
                # The weights themselves are the fp32 master when they are fp32 and this rank's alone:
                # replicated without sharding, or their shard under ZeRO-3.
                owns = p.dtype != torch.float32 or (self.distributed and self.sharder is None)
                master = values.to(torch.float32, copy=True) if owns else values
                master.grad = buffer.local_grad(p)
                entries.append(_Entry(names[id(p)], p, r[0], r[1], master, owns, buffer))
        return entries

    def _values(self, p, r: tuple) -> torch.Tensor:
        """The weights of p's elements [r[0], r[1]) (flat): a view of the parameter, or of its ZeRO-3 shard."""
        if self.sharder is not None:
            return self.sharder.local_param(p)
        return p.detach().view(-1)[r[0]:r[1]]

    def full_weights(self, writeback: bool = False):
        """A context in which every weight is whole (checkpoint save and load; ZeRO-3 gathers them, and with
        `writeback` what was loaded into them becomes the shards; ZeRO-1/2 waits for the gathers in flight)."""
        if self.sharder is not None:
            return self.sharder.gathered(writeback)
        self.wait_weights()
        return contextlib.nullcontext()

    def wait_weights(self) -> None:
        """Wait for the all-gathers of the last step's weights still in flight (--overlap-param-gather under
        ZeRO-1/2) and gather the FP8 weights' values (--fp8-param-gather moved their codes only), so that the
        model's weights are current outside forward; a no-op otherwise."""
        if self.gather is not None:
            self.gather.finish()
        if self.fp8 is not None and self.fp8.stale:
            held = self.fp8.holding()
            for i, bucket in self.fp8.stale_buckets():
                self._gather_whole(self.buffers[i], bucket)
            self.fp8.refreshed(held)

    # --- the step, in the order the trainer calls it -------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Zero the main grads and expect `num_microbatches` backward passes before the reduction."""
        for buffer in self.buffers:
            buffer.start_step(num_microbatches)
        if self.sharder is not None:
            self.sharder.start_step()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        scale = self.scaler.scale
        return loss * scale if scale != 1.0 else loss

    def finish_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.finish()

    def step(self, lr: float, loss_is_finite: bool = True) -> StepResult:
        """Clip and update at learning rate `lr`, or skip: a non-finite loss skips outright (its gradients
        cannot be trusted even when their norm is finite), a non-finite gradient norm through the scaler."""
        scale = self.scaler.scale
        if not loss_is_finite:
            return self._skipped(float("nan"), scale)
        dense, experts = self.norm_pieces()
        norm = global_grad_norm(dense, self.ctx, sharded_over_dp=self.distributed, device=self.buffer.data.device,
                                expert_grads=experts) / scale
        return self.finish_step(lr, norm, scale)

    def norm_pieces(self) -> tuple:
        """(dense, expert or None): this rank's gradient pieces that count toward the global norm (clip.py)."""
        counted = [e.master.grad for e in self._entries if counts_toward_norm(e.param, self.ctx)]
        experts = [e.master.grad for e in self._entries if e.buffer.experts and counts_toward_norm(e.param, self.ctx)]
        dense = [g for g in counted if not any(g is x for x in experts)]
        return dense, (experts if len(self.buffers) > 1 else None)

    def finish_step(self, lr: float, norm: float, scale: float) -> StepResult:
        """Given the global norm (loss scale `scale` removed): update the scaler, then skip (inf/nan) or clip
        and update."""
        found_inf = not math.isfinite(norm)
        self.scaler.update(found_inf)
        if found_inf:
            return self._skipped(norm, self.scaler.scale)
        self.update(lr, clip_coefficient(norm, self.clip_grad) / scale)
        return StepResult(True, norm, self.scaler.scale)

    def _skipped(self, norm: float, scale: float) -> StepResult:
        """No update. The delayed histories moved all the same, so --fp8-param-gather's codes (ZeRO-1/2) no longer
        hold: the FP8 weights are gathered whole (wait_weights) and forward quantizes them. (ZeRO-3 packs its
        codes afresh before its next gather.)"""
        if self.fp8 is not None:
            self.wait_weights()
        return StepResult(False, norm, scale)

    def update(self, lr: float, factor: float) -> None:
        """AdamW at rate `lr` on the gradients times `factor` (unscaling and clipping), then publish; a
        schedule.StepLR gives the vocabulary tables their decoupled rate."""
        if factor != 1.0:
            for buffer in self.buffers:
                buffer.scale_local_grads(factor)
        if self.adam is not None:
            for group in self.adam.param_groups:
                group["lr"] = getattr(lr, "decoupled", lr) if group.get("decoupled") else float(lr)
            self.adam.step()
        if self.muon is not None:
            self.muon.step(lr)
        self.steps += 1
        self.publish()

    def rollback_tensors(self) -> list:
        """What an update changes on this rank (masters, or the weights that are their own masters, and the
        Adam moments or Muon momenta) and what it reads (the gradients): post-validation copies them to undo a
        step."""
        out = []
        for e in self._entries:
            out += [e.master, e.master.grad, *self._state(e).values()]
        return out

    def _state(self, e: _Entry) -> dict:
        """The optimizer state of entry `e` by its checkpoint key: Muon's momentum or Adam's two moments."""
        if id(e) in self._muon_entries:
            return {"momentum": self.muon.momentum(e.master)}
        if self.adam is None:
            return {}
        return dict(zip(("exp_avg", "exp_avg_sq"), adamw.moments(self.adam, e.master)))

    def publish(self) -> None:
        """Copy the updated masters into the model's parameters (all-gathered over dp when sharded)."""
        if not self.distributed or self.sharder is not None:
            for e in self._entries:
                if e.owns_master:
                    self._publish_own(e)
            if self.sharder is not None:
                self.sharder.changed()
            return
        if self.gather is not None:  # in flight until the next forward needs them (param_gather.py)
            return self.gather.start(self._entries)
        if self.fp8 is not None:  # this rank's shards first: the FP8 codes are made from them
            for e in self._entries:
                self._publish_own(e)
            self.fp8.prepare()
        for i, buffer in enumerate(self.buffers):
            for bucket in buffer.buckets:
                if self.fp8 is not None and self.fp8.covers(i, bucket):
                    self.fp8.launch(i, bucket, async_op=False)
                    self.fp8.land(i, bucket)
                else:
                    self._gather_whole(buffer, bucket)

    def _entries_by_bucket(self) -> dict:
        """(id(buffer), bucket index) -> [(entry, its parameter's offset in the bucket)], made once: the step's
        gathers look entries up by bucket rather than scanning them all for each bucket."""
        out = {}
        for e in self._entries:
            bucket, off = e.buffer.offset_in_bucket(e.param)
            out.setdefault((id(e.buffer), bucket.index), []).append((e, off))
        return out

    def _publish_own(self, e) -> None:
        """Entry e's updated master into its weight's elements on this rank."""
        self._values(e.param, (e.start, e.end)).copy_(e.master)

    def _gather_whole(self, buffer: GradBuffer, bucket) -> None:
        """All-gather one bucket's updated masters, in the parameters' dtype, into its parameters. Without other
        replicas this rank holds every master of the bucket, and each goes straight into its parameter: through the
        gather buffer each was copied twice (about 98 of the 444 copies of the H200's 1.24B step of 2026-11-27)."""
        entries = self._in_bucket.get((id(buffer), bucket.index), [])
        if buffer.replicas == 1:
            for e, _ in entries:
                self._publish_own(e)
            return
        out = self._gather_buffer(bucket)
        lo, hi = buffer.shard_bounds(bucket)
        for e, off in entries:
            out[off + e.start:off + e.end].copy_(e.master)
        comm.all_gather_into(out, out[lo:hi], group=buffer.group)
        for p in bucket.params:
            _, off = buffer.offset_in_bucket(p)
            p.detach().view(-1).copy_(out[off:off + p.numel()])

    def _gather_buffer(self, bucket) -> torch.Tensor:
        """One reusable all-gather target per dtype, as large as the largest bucket of that dtype that is gathered
        (a buffer with other replicas: engine.planner.sharding counts it so)."""
        size = max(b.size for buffer in self.buffers if buffer.replicas > 1 for b in buffer.buckets
                   if b.dtype == bucket.dtype)
        buf = self._gather_out.get(bucket.dtype)
        if buf is None:
            buf = self._gather_out[bucket.dtype] = torch.empty(size, dtype=bucket.dtype, device=self.buffer.data.device)
        return buf[:bucket.size]

    # --- state ---------------------------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes this rank keeps between steps: weights (their shards under ZeRO-3), gradients (their shards
        under ZeRO-2/3) and optimizer state (fp32 masters it owns and the Adam moments)."""
        params = [p for b in self.buffers for p in b.params]
        weights = self.sharder.shard_bytes() if self.sharder is not None else \
            sum(p.numel() * p.element_size() for p in params)
        return {"params": weights, "grads": sum(b.grad_bytes() for b in self.buffers), "optimizer": self.state_bytes()}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its own fp32 masters and the Adam state."""
        tensors = [e.master for e in self._entries if e.owns_master]
        if self.adam is not None:
            tensors += adamw.state_tensors(self.adam)
        if self.muon is not None:
            tensors += self.muon.momenta
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        params = {}
        for e in self._entries:
            entry = {"range": (e.start, e.end), "numel": e.param.numel(), "shape": tuple(e.param.shape)}
            entry.update(self._state(e))
            if e.owns_master:
                entry["master"] = e.master
            params[e.name] = entry
        return {"step": self.steps, "scaler": self.scaler.state_dict(), "distributed": self.distributed,
                "optimizer": self.name, "params": params}

    def load_state_dict(self, state: dict) -> None:
        """Load moments and masters (from matching ranges or whole tensors); load the model weights first."""
        saved_name = state.get("optimizer", "adam")
        if saved_name != self.name:
            raise ValueError(f"the optimizer state is {saved_name}'s, and this optimizer is {self.name}")
        for e in self._entries:
            saved = state["params"].get(e.name)
            if saved is None:
                raise KeyError(f"optimizer state has no entry for parameter {e.name!r}")
            for key, tensor in self._state(e).items():
                tensor.copy_(self._slice(saved, key, e))
            if e.owns_master:
                source = self._slice(saved, "master", e) if "master" in saved else self._values(e.param, (e.start, e.end))
                e.master.copy_(source)
        self.steps = int(state["step"])
        if self.adam is not None:
            adamw.set_step(self.adam, self.steps)
        self.scaler.load_state_dict(state["scaler"])

    @staticmethod
    def _slice(saved: dict, key: str, e: _Entry) -> torch.Tensor:
        t = saved[key].reshape(-1)
        start, end = saved.get("range", (0, t.numel()))
        if (start, end) == (e.start, e.end):
            return t
        if (start, end) == (0, e.param.numel()):
            return t[e.start:e.end]
        raise ValueError(f"optimizer state of {e.name!r} covers elements [{start}, {end}) but this rank updates "
                         f"[{e.start}, {e.end}); reshard the checkpoint or give whole tensors")

    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model's parameters (after loading weights without optimizer state)."""
        for e in self._entries:
            if e.owns_master:
                e.master.copy_(self._values(e.param, (e.start, e.end)))

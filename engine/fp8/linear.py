"""The FP8 linear: y = x W^T + b with its three GEMMs (forward, input gradient, weight gradient) in FP8.

Each GEMM quantizes its two operands along their contraction dimension: forward x [T, K] and W [N, K]; input
gradient dy [T, N] and W^T; weight gradient dy^T [N, T] and x^T [K, T]. Under tensor scaling x, W and dy are
quantized once and transposed for the later GEMMs (x and dy in the same pass as their codes: `Scaler.tensor`'s
`transposed`); under blockwise scaling x and dy are quantized again along
the tokens for the weight gradient (1x128 tiles along the contraction, as DeepSeek-V3 does), W's 128x128 tiles
serve both of its GEMMs. Biases and everything outside the GEMMs stay in the run's precision.

`Fp8Linear` is what a column- or row-parallel layer calls when FP8 is on (engine.fp8.attach gives it one). It
knows where the layer's tensors are split: under tp the weight (and a row-parallel input, a column-parallel
output gradient) is one part of a full tensor, whose amax (tensor scaling) or tiles (blockwise) the tp group
shares; under cp and sequence parallelism the tokens are. Under a split backward (zero-bubble schedules) the
weight gradient is left to engine.parallel.weight_grad_store like any linear's.

Under sequence parallelism a column-parallel linear's input enters the tensor-parallel region all-gathered
(`enter`), and a row-parallel linear's output gradient comes back into it all-gathered in backward (`leave`).
With tensor scaling each rank quantizes its [s/tp, b, h] shard with the whole tensor's scale (current scaling's
amax is the tp group's anyway, a history's scale is the same on every rank) and the FP8 codes are all-gathered:
1 byte an element on the wire where the bf16 gather sends 2, and the codes are those of quantizing the gathered
tensor, bit for bit (Transformer Engine gathers FP8 likewise). The reduce-scatters (a column-parallel input's
gradient, a row-parallel output) stay in the run's precision. Blockwise scaling gathers bf16: the weight gradient
quantizes x^T and dy^T along the tokens, in tiles that cross the shards.

Under `--fp8-param-gather` the weight arrives quantized: the optimizer's all-gather (engine.optim.fp8_gather;
under ZeRO-3 each unit gather, engine.optim.fp8_shard) quantizes each replica's shard with the scale this linear
would use and gathers the FP8 codes, and `gathered`
holds them (`Gathered`) until the weight changes (its version counter) or the scale does (a delayed history
moved); forward then takes them instead of quantizing the weight, the same codes and scale bit for bit.

Without the flag, within one step's forward/backward schedule of several microbatches the weight does not change,
so the linear quantizes it once: `held` keeps forward's Q(W) and its transpose (the input gradient's operand,
made in the same pass under tensor scaling, by the first backward under blockwise), for the later microbatches;
engine.fp8.weights_held turns this on for the schedule and drops them after it. That is one pass over W a step
(its codes, their transpose and its amax, `both_ways`) instead of one per microbatch (Transformer Engine caches its
FP8 weights across microbatches likewise), the same codes and scale bit for bit, and one copy of Q(W) however many
microbatches are in flight. Not under ZeRO-3, whose point is not to keep whole weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.fp8 import gemm
from engine.fp8.quantize import Quantized, Split, one_pass
from engine.fp8.scaling import ACTIVATION_TILE, WEIGHT_TILE, Recipe, Scaler
from engine.parallel import comm, mappings
from engine.parallel.weight_grad_store import bias_grad, deferral_of, rows

# False: under sequence parallelism a column-parallel linear's input and a row-parallel one's output gradient are
# gathered in the run's precision, then quantized (as before 2026-11-27), to compare the bytes sent; the same
# numbers either way
GATHER_CODES = True


def _split_positions(spec, ctx) -> tuple:
    """(the axis of rows(W) split over tp, its local rows' or columns' places in the full rows(W), full count)."""
    full = spec.full_shape
    if spec.tp_axis == len(full) - 1:  # row-parallel: input columns
        n = full[-1] // ctx.tp_size
        return 1, torch.arange(n) + ctx.tp_rank * n, full[-1]
    out = full[spec.tp_axis]  # column-parallel, blocks stacked on axis 0 when [stack, out, in]
    n, stack = out // ctx.tp_size, (full[0] if len(full) == 3 else 1)
    local = torch.arange(n) + ctx.tp_rank * n
    return 0, torch.cat([local + b * out for b in range(stack)]), stack * out


@dataclass
class Held:
    """W quantized here for this step's first microbatch: its codes and scale, the amax that call noted (`now`,
    noted again by each later microbatch as its own call would; None where there is nothing to note again) and the
    weight's version then; `t`: the transposed codes the input gradient takes, once the first backward has taken
    them (made with the codes, `Fp8Linear.both_ways`, or apart)."""
    q: Quantized
    now: object
    version: int
    t: Optional[Quantized] = None


@dataclass
class Gathered:
    """The weight's FP8 codes and scale from the optimizer's gather, as `Scaler.tensor` would make them, with
    `now` (the amax that call would note) and when they hold: the weight's version and the scaler's step count.
    `whole`: the weight's own values are whole too (off the hot path they are refreshed, Optimizer.wait_weights);
    until then only this rank's shard of them is current, so a weight that changed scale cannot be quantized."""
    q: Quantized
    now: object
    version: int
    steps: int
    whole: bool = False


class Fp8Linear:
    """The FP8 GEMMs of one tensor-parallel linear: its scalers and where its tensors are split."""

    def __init__(self, recipe: Recipe, weight, ctx):
        device = weight.device if weight.device.type != "meta" else None
        self.recipe = recipe
        self.input, self.weight, self.grad = (Scaler(recipe, False, device), Scaler(recipe, False, device),
                                              Scaler(recipe, True, device))
        self.group = ctx.tp_cp_group if ctx.tp_size * ctx.cp_size > 1 else None
        self.entry = ctx  # whose tensor-parallel collectives `enter` and `leave` take where they gather no codes
        self.seq_group = ctx.tp_group if ctx.sequence_parallel and ctx.tp_size > 1 and not recipe.blockwise else None
        self.split_axis, self.splits = None, {}
        self.gathered = None  # a Gathered under --fp8-param-gather
        self.may_hold = not ctx.layout.sharding.params  # ZeRO-3 keeps no whole weight between its unit gathers
        self.holding, self.held = False, None  # within a schedule (engine.fp8.weights_held): a Held
        if ctx.tp_size > 1:
            axis, positions, full = _split_positions(weight.spec, ctx)
            self.split_axis = axis
            # row-parallel: W's and x's columns; column-parallel: W's rows and dy's columns
            self.splits = {"weight": Split(axis, positions, full, ctx.tp_group),
                           ("input" if axis == 1 else "grad"): Split(1, positions, full, ctx.tp_group)}

    def quantize(self, role: str, x: torch.Tensor, transposed: bool = False):
        """One operand: `role` input | weight | grad; `transposed`: x^T for the weight gradient (tokens last)."""
        scaler = getattr(self, role)
        if not self.recipe.blockwise:  # made with its transpose where a GEMM takes it transposed too (`both_ways`)
            q = scaler.tensor(x, self.group, transposed=self.both_ways(role) and one_pass())
        else:
            q = scaler.tiles(x, WEIGHT_TILE if role == "weight" else ACTIVATION_TILE,
                             None if transposed else self.splits.get(role))
        if not transposed:
            scaler.last = q.scale_inv  # the full tensor's scale(s), the same under every layout
        return q

    def both_ways(self, role: str) -> bool:
        """Whether the `role` operand is quantized with its transpose in one pass: an input or gradient always (the
        weight gradient takes them transposed); W when it is held for the schedule, whose backwards take Q(W)^T
        (the input gradient's operand): the pass writes it for one byte an element more, where a transpose of the
        codes apart reads and writes them again (on the H200 a strided copy: 64 a step for the 1.24B model, 5.7 ms
        in all). The price: the transpose exists from the first forward, where the first backward made it, so a
        pipeline's warm-up peak holds one byte per weight element more (Transformer Engine likewise makes an FP8
        weight's transpose with its codes at the first microbatch). An evaluation schedule holds W too and leaves
        that transpose unused, once a schedule. A W quantized per microbatch (not held: ZeRO-3) keeps its transpose
        apart, made in backward: not kept from forward to backward for every microbatch in flight."""
        return role != "weight" or self.holding

    def gathers(self) -> Optional[object]:
        """The tp group an entering input's (a leaving output's gradient's) FP8 codes are all-gathered over, or None
        (gathered before quantizing, or not gathered)."""
        return self.seq_group if GATHER_CODES else None

    def operand(self, role: str, x2, gather=None) -> Quantized:
        """Q(x2), x2 [tokens, K] the `role` input | grad; with `gather`, x2 holds this rank's rows of the tensor
        split over that group along the sequence: quantized with the whole tensor's scale, the codes all-gathered."""
        if gather is None:
            return self.quantize(role, x2)
        scaler = getattr(self, role)
        q = scaler.tensor(x2, self.group)
        scaler.last = q.scale_inv
        codes = torch.empty((x2.shape[0] * comm.world_size(gather), x2.shape[1]), dtype=torch.uint8,
                            device=x2.device)
        comm.all_gather_into(codes, q.data.view(torch.uint8), gather)
        return Quantized(codes.view(q.data.dtype), q.scale_inv)

    def hold(self, on: bool) -> None:
        """Keep (on) or drop (off) the Q(W) made within a step's schedule."""
        self.holding, self.held = on, self.held if on else None

    def weight_operand(self, weight):
        """Forward's Q(W): the gathered codes while they hold, else W quantized here."""
        g = self.gathered
        if g is not None and g.version == weight._version:
            if g.steps == self.weight.steps:
                self.weight.saw(g.now)
                self.weight.last = g.q.scale_inv
                return g.q
            if not g.whole:
                raise RuntimeError("an FP8 weight's scale moved after its codes were gathered, and its values are "
                                   "current on this rank's shard only: gather the weights after the amax "
                                   "histories move")
        h = self.held
        if h is not None and h.version == weight._version:
            if h.now is not None:  # None: tiles (no amax), or the codes kernel max-ed it into the step's amax in place
                self.weight.saw(h.now)
            self.weight.last = h.q.scale_inv
            return h.q
        q = self.quantize("weight", rows(weight))
        if self.holding:
            self.held = Held(q, self.weight.noted, weight._version)  # (tiles note no amax: None)
        return q

    def weight_transposed(self, wq: Quantized) -> Quantized:
        """The input gradient's operand Q(W)^T: made once a step when `wq` is the held Q(W)."""
        h = self.held
        if h is None or h.q is not wq:
            return wq.t()
        if h.t is None:
            h.t = wq.t()
        return h.t

    def __call__(self, x, weight, bias=None, gather=None, scatter=None):
        """`gather`: x is this rank's sequence shard, whose codes are gathered over that group (`enter`);
        `scatter`: the output is reduce-scattered over that group, its gradient's codes gathered (`leave`)."""
        deferral = deferral_of(weight)
        return _Fp8LinearFn.apply(x, weight if deferral is None else weight.detach(), bias, self, deferral, gather,
                                  scatter)

    def entering(self, x) -> tuple:
        """(x as the GEMMs take it, the group they gather its codes over): this rank's shard and the tp group where
        `gathers`, else x entered into the tensor-parallel region by mappings, and None."""
        gather = self.gathers()
        return (x, gather) if gather is not None else (mappings.enter_tp(x, self.entry), None)

    def leaving(self, y, scattered):
        """The GEMMs' output y out of the tensor-parallel region: as it is where they `scattered` it themselves."""
        return y if scattered is not None else mappings.exit_tp(y, self.entry)

    def enter(self, x, weight, bias=None):
        """A column-parallel linear: x enters the tensor-parallel region (its codes gathered where `gathers`)."""
        x, gather = self.entering(x)
        return self(x, weight, bias, gather)

    def leave(self, x, weight):
        """A row-parallel linear: its partial sums leave the tensor-parallel region (their gradient's codes
        gathered where `gathers`)."""
        scatter = self.gathers()
        return self.leaving(self(x, weight, scatter=scatter), scatter)


def entered_shape(x, gather) -> tuple:
    """The shape of x [s/tp, ...] once gathered along the sequence over `gather` (x's own without one)."""
    return x.shape if gather is None else (x.shape[0] * comm.world_size(gather), *x.shape[1:])


def scatter_seq(t, group):
    """t [s, ...] summed over `group` and cut to this rank's sequence shard; t itself without a group (or None)."""
    return t if group is None or t is None else mappings.reduce_scatter_seq(t, group)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lin: Fp8Linear, deferral, gather, scatter):
        x2 = x.reshape(-1, x.shape[-1])
        xq, wq = lin.operand("input", x2, gather), lin.weight_operand(weight)
        y = gemm.mm(xq, wq, x.dtype)
        if bias is not None:
            y = y + bias.reshape(-1)
        # what the weight gradient contracts over the tokens: x^T quantized along them
        ctx.xt = lin.quantize("input", x2.t(), transposed=True) if lin.recipe.blockwise else xq.t()
        ctx.wq, ctx.lin, ctx.deferral, ctx.gather, ctx.scatter = wq, lin, deferral, gather, scatter
        x_shape = entered_shape(x, gather)
        ctx.shapes = (x_shape, weight.shape, weight.dtype, None if bias is None else bias.shape)
        return scatter_seq(y.view(*x_shape[:-1], y.shape[-1]), scatter)

    @staticmethod
    def backward(ctx, dy):
        lin, (x_shape, w_shape, w_dtype, b_shape) = ctx.lin, ctx.shapes
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq = lin.operand("grad", dy2, ctx.scatter)
        dx = gemm.mm(dyq, lin.weight_transposed(ctx.wq), dy.dtype).view(x_shape) if ctx.needs_input_grad[0] else None
        dyt = lin.quantize("grad", dy2.t(), transposed=True) if lin.recipe.blockwise else dyq.t()
        xt = ctx.xt

        def weight_grad():
            return gemm.mm(dyt, xt, w_dtype).view(w_shape)

        dw = weight_grad() if ctx.needs_input_grad[1] else None
        if ctx.deferral is not None:
            param, store = ctx.deferral
            store.append((param, weight_grad))
        db = bias_grad(dy, b_shape) if b_shape is not None and ctx.needs_input_grad[2] else None
        return scatter_seq(dx, ctx.gather), dw, db, None, None, None, None

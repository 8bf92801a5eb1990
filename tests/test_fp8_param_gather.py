"""`--fp8-param-gather` (engine/optim/fp8_gather.py, fp8_shard.py, fp8_codes.py): the sharded weights' gathers move
the FP8 linears' and the routed experts' weights as their FP8 codes, and the run is the one without the flag, bit
for bit.

At dp 2 (one spawned pair of ranks), `optim` and `optim_grads`, tensorwise and delayed scaling, with the gather at
the end of the step and overlapped with the next forward (and tensorwise at tp 2, delayed with bf16 weights, and
the MoE model, its experts sharded over the 2 replicas): the loss curve, the final weights and every FP8 weight
operand forward used (codes and scale: each linear's, each expert's) equal the run without the flag, and from the
second step on forward takes the gathered codes instead of quantizing. Under ZeRO-3 (`optim_grads_params`:
tensorwise, delayed with prefetch, delayed with full recomputation and a skipped update, tensorwise at tp 2 with
prefetch) the unit gathers move the codes and forward takes them from the first step on. The all-gathers move one
byte per element of the FP8 weights in each replica's payload (the analytic count below: per step under ZeRO-1/2,
twice a microbatch under ZeRO-3), the scales cost one all-reduce of a vector a step per buffer (the experts' one
amax per expert). A checkpoint saved with the flag after 3 steps (ZeRO-1 and ZeRO-3) and resumed gives the
uninterrupted curve and weights. On 4 ranks (one spawned group), ZeRO-3 with the flag is the run without it bit
for bit at dp 2 x pp 2 (and interleaved vpp 2), dp 2 x cp 2 and, for the MoE model, dp 4 x ep 2, where ZeRO-1
and -2 are too: the experts' gathers (over their 2 replicas; an expert's weight straddles them) move one byte per
expert element. Misuses are one line each.
"""
import contextlib

import pytest
import torch
from test_fp8_layouts import _cfg as _layouts_cfg
from test_fp8_layouts import MICROBATCHES, _microbatches

from engine import fp8
from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.saver import save_checkpoint
from engine.cli import parse_config
from engine.config import ConfigError
from engine.fp8.experts import Fp8Experts
from engine.fp8.linear import Fp8Linear, Gathered
from engine.fp8.scaling import Recipe
from engine.layout import Layout
from engine.optim import build_optimizer, lr_at
from engine.parallel import comm
from engine.parallel.layers import ColumnParallelLinear
from engine.parallel.topology import ParallelContext, context_for
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.validation import validate
from harness import run_ranks

STEPS, VOCAB, SEQ = 6, 96, 16
ZERO3 = "optim_grads_params"


def _cfg(recipe: str, strategy: str, flag: bool, overlap: bool = False, tp: int = 1, bf16: bool = False,
         recompute: bool = False, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int = 1, moe: bool = False):
    """The tiny Llama of test_fp8_layouts (its MoE variant with `moe` or ep > 1; 2 layers a model chunk under
    vpp)."""
    cfg = _layouts_cfg(recipe, strategy=strategy, tp=tp, pp=pp, cp=cp, ep=ep, moe=moe or ep > 1)
    if vpp > 1:
        cfg.parallel.virtual_pipeline_model_parallel_size, cfg.model.num_layers = vpp, 2 * pp * vpp
    cfg.training.bf16 = bf16
    cfg.model.recompute_granularity = "full" if recompute else None
    cfg.training.fp8_param_gather, cfg.parallel.overlap_param_gather = flag, overlap
    return cfg


class _Spy:
    """Every FP8 weight operand forward takes, each linear's (`seen`) and each routed expert's (`experts`):
    (whether it was the gathered codes, codes as bytes, decode scale)."""

    def __init__(self):
        self.seen, self._orig = [], Fp8Linear.weight_operand
        self.experts, self._orig_experts = [], Fp8Experts.weights

    def __enter__(self):
        def spy(lin, weight):
            g = lin.gathered
            hit = g is not None and g.version == weight._version and g.steps == lin.weight.steps
            q = self._orig(lin, weight)
            self.seen.append((hit, q.data.view(torch.uint8).clone(), q.scale_inv.clone()))
            return q

        def spy_experts(ex, w, n):
            g = ex.gathered.get(id(w))
            hit = g is not None and g.version == w._version
            qs = self._orig_experts(ex, w, n)
            self.experts += [(hit, q.data.view(torch.uint8).clone(), q.scale_inv.clone()) for q in qs]
            return qs
        Fp8Linear.weight_operand, Fp8Experts.weights = spy, spy_experts
        return self

    def __exit__(self, *exc):
        Fp8Linear.weight_operand, Fp8Experts.weights = self._orig, self._orig_experts


def _linear_weights(chunks) -> set:
    return {id(m.weight) for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Linear)}


def _expert_weights(chunks) -> list:
    """The routed experts' stacked weights (fc1, fc2 of each MoE layer), FP8 through Fp8Experts."""
    return [p for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Experts)
            for p in (m.fc1, m.fc2)]


def _fp8_weights(chunks) -> set:
    """Every weight --fp8-param-gather moves as codes: the FP8 linears' and the routed experts'."""
    return _linear_weights(chunks) | {id(p) for p in _expert_weights(chunks)}


def _analytic_gather_bytes(opt, fp8_ids: set, buffers=None) -> int:
    """Bytes the step's all-gathers produce (of `buffers`, default the optimizer's): per bucket holding FP8
    weights, every replica's payload as long as the longest one (one byte per FP8 element, the parameter's size for
    the others), else the bucket itself."""
    total = 0
    for buffer in opt.buffers if buffers is None else buffers:
        for bucket in buffer.buckets:
            size = bucket.params[0].element_size()
            if not any(id(p) in fp8_ids for p in bucket.params):
                total += bucket.size * size
                continue
            longest = max(sum((r[1] - r[0]) * (1 if id(p) in fp8_ids else size) for p in bucket.params
                              if (r := buffer.local_range(p, rep)) is not None) for rep in range(buffer.replicas))
            total += buffer.replicas * (-(-longest // size) * size)
    return total


def _count(ctx) -> int:
    """Microbatches a step: test_fp8_layouts' 2, or one per dp rank and pp stage (pp each: 1F1B's steady state,
    and the interleaved schedule's multiple of pp)."""
    return max(MICROBATCHES, ctx.dp_size * ctx.pp_size)


def _train(cfg, ctx, chunks, opt, steps, skip=()) -> tuple:
    """(losses, the last step's collectives: its optimizer step's, and under ZeRO-3, whose unit gathers run in
    forward and backward, the whole step's); the steps in `skip` skip their update (as for a non-finite loss)."""
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float32
    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, 1, cfg.model.hidden_size), dtype, "cpu")
    losses, counted, zero3 = [], None, opt.sharder is not None
    for step in steps:
        per_rank = _count(ctx) // ctx.dp_size
        mine = _microbatches(step, _count(ctx))[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
        with comm.counting() if zero3 else contextlib.nullcontext() as whole:
            opt.start_step(len(mine))
            losses.append(runner.run(mine, scale_loss=opt.scale_loss))
            opt.finish_grad_sync()
            fp8.finish_step(chunks, ctx)
            with contextlib.nullcontext(whole) if zero3 else comm.counting() as counter:  # overlapped gathers
                opt.step(lr_at(step, cfg.optim, STEPS), step not in skip)             # count when launched
        counted = counter
    return losses, counted


def _run(rank, world, cfg, load=None, save=None, steps=range(STEPS), skip=()) -> dict:
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
    try:
        chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB,
                                    dtype=torch.bfloat16 if cfg.training.bf16 else torch.float32)
        opt = build_optimizer(cfg, chunks, ctx, bucket_numel=3000)
        if load is not None:
            load_checkpoint(load, chunks, opt, ctx)
        with _Spy() as spy:
            losses, counter = _train(cfg, ctx, chunks, opt, steps, skip)
        flag, fp8_ids, stacks = cfg.training.fp8_param_gather, _fp8_weights(chunks), _expert_weights(chunks)
        gathered = sum(r.payload for r in counter.records  # the weights' gathers (not sequence parallelism's)
                       if r.op == "all_gather" and any(r.group is b.group for b in opt.buffers))
        amax_reduces = [r for r in counter.records if r.op == "all_reduce"
                        and r.payload == 4 * len(_linear_weights(chunks))]
        expert_scales = sum(p.shape[0] for p in stacks)  # one amax per expert
        experts = opt.expert_buffer if opt.expert_buffer in opt.buffers else None
        expert_amax_reduces = [r for r in counter.records if r.op == "all_reduce" and experts is not None
                               and r.group is experts.group and r.payload == 4 * expert_scales]
        split = experts is not None and experts.group is not opt.buffer.group  # their own replicas (ep > 1)
        experts_gathered = sum(r.payload for r in counter.records if r.op == "all_gather" and split
                               and r.group is experts.group)
        # ZeRO-3 gathers every unit twice a microbatch (forward, backward), ZeRO-1/2 every bucket once a step
        passes = 2 * _count(ctx) // ctx.dp_size if opt.sharder is not None else 1
        expected = _analytic_gather_bytes(opt, fp8_ids if flag else set()) * passes
        experts_expected = passes * _analytic_gather_bytes(opt, fp8_ids if flag else set(), [experts]) \
            if split else 0
        if save is not None:
            save_checkpoint(save, steps[-1] + 1, chunks, opt, ctx, cfg, {})
        with opt.full_weights():
            weights = {f"{c}.{n}": p.detach().clone() for c, chunk in enumerate(chunks)
                       for n, p in chunk.named_parameters()}
        return dict(losses=losses, weights=weights, operands=spy.seen, expert_operands=spy.experts,
                    gathered=gathered, expected=expected, experts_gathered=experts_gathered,
                    experts_expected=experts_expected, amax_reduces=len(amax_reduces),
                    expert_amax_reduces=len(expert_amax_reduces) if stacks else None,
                    fp8_elements=sum(p.numel() for b in opt.buffers for p in b.params if id(p) in fp8_ids),
                    expert_elements=sum(p.numel() for p in stacks),
                    expert_padded=passes * sum(b.size for b in experts.buckets) if split else 0)
    finally:
        ctx.destroy()


def _same(name, got, want) -> list:
    out = [] if got["losses"] == want["losses"] else [f"{name}: losses {got['losses']} vs {want['losses']}"]
    out += [f"{name}: weight {k} differs" for k in want["weights"] if not torch.equal(got["weights"][k],
                                                                                     want["weights"][k])]
    for key, what in (("operands", "FP8 weight"), ("expert_operands", "FP8 expert weight")):
        if len(got[key]) != len(want[key]) or not all(
                torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(got[key], want[key])):
            out.append(f"{name}: {what} codes or scales differ")
    return out


def _cases(rank, world, ckpt) -> tuple:
    problems, rows = [], []
    layouts = [(recipe, strategy, overlap, 1, False, False) for recipe in ("tensorwise", "delayed")
               for strategy, overlap in (("optim", False), ("optim_grads", False), ("optim", True))]
    # tp 2: one replica, the amaxes reduced over tp; bf16 weights: 2-byte elements beside the codes
    layouts += [("tensorwise", "optim", False, 2, False, False), ("delayed", "optim_grads", True, 1, True, False)]
    # ZeRO-3: the unit gathers move the codes; with prefetch (overlap) and with full recomputation
    layouts += [("tensorwise", ZERO3, False, 1, False, False), ("delayed", ZERO3, True, 1, False, False),
                ("delayed", ZERO3, False, 1, False, True), ("tensorwise", ZERO3, True, 2, False, False)]
    # recompute: full recomputation, and the third step's update skipped (its delayed histories move all the same)
    layouts += [("delayed", "optim", True, 1, False, True)]
    layouts = [layout + (False,) for layout in layouts]
    # the MoE model (ep 1: its experts sharded over the same 2 replicas, in their own buffer), the skip included
    layouts += [("tensorwise", "optim_grads", False, 1, False, False, True), ("delayed", "optim", True, 1, False, True,
                                                                              True)]
    for recipe, strategy, overlap, tp, bf16, recompute, moe in layouts:
        skip = {2} if recompute else set()
        name = f"{recipe} {strategy}{' overlap' if overlap else ''} tp{tp}{' bf16' if bf16 else ''}" + (
            " recompute skip3" if recompute else "") + (" moe" if moe else "")
        want = _run(rank, world, _cfg(recipe, strategy, False, overlap, tp, bf16, recompute, moe=moe), skip=skip)
        got = _run(rank, world, _cfg(recipe, strategy, True, overlap, tp, bf16, recompute, moe=moe), skip=skip)
        problems += _same(name, got, want) + _hits(name, got, want, strategy == ZERO3, len(skip))
        rows.append((name, got["gathered"], got["expected"] if tp == 1 else 0, want["gathered"],
                     want["expected"] if tp == 1 else 0, got["amax_reduces"], got["fp8_elements"],
                     got["expert_amax_reduces"]))
    for strategy in ("optim", ZERO3):
        problems += _resumed(rank, world, _cfg("delayed", strategy, True, overlap=strategy == ZERO3),
                             f"{ckpt}/{strategy}")
    return problems, rows


def _hits(name, got, want, zero3: bool, skipped: int = 0, steps: int = STEPS) -> list:
    """Forward takes the gathered codes from the second step on (ZeRO-1/2) but after a skipped update (a linear's:
    its delayed history moved; the experts' scales follow none, and their codes still hold), or always (ZeRO-3);
    never without the flag."""
    out = []
    for key, missed in (("operands", skipped), ("expert_operands", 0)):
        hits = sum(h for h, _, _ in got[key])
        per_step = len(got[key]) // steps
        expected = len(got[key]) if zero3 else per_step * (steps - 1 - missed)
        if hits != expected or any(h for h, _, _ in want[key]):
            out.append(f"{name}: forward took the gathered {key} {hits} times, not {expected}")
    return out


def _resumed(rank, world, cfg, ckpt) -> list:
    """Saved after 3 steps and resumed: the uninterrupted run's curve and weights."""
    whole = _run(rank, world, cfg)
    _run(rank, world, cfg, save=f"{ckpt}/ck", steps=range(3))
    resumed = _run(rank, world, cfg, load=f"{ckpt}/ck", steps=range(3, STEPS))
    strategy = cfg.parallel.data_parallel_sharding_strategy
    problems = _same(f"resumed {strategy}", dict(resumed, losses=whole["losses"][:3] + resumed["losses"],
                                                 operands=whole["operands"],
                                                 expert_operands=whole["expert_operands"]), whole)
    if resumed["losses"] != whole["losses"][3:]:
        problems.append(f"resumed {strategy}: {resumed['losses']} vs {whole['losses'][3:]}")
    if strategy == ZERO3 and not all(h for h, _, _ in resumed["operands"]):
        problems.append(f"resumed {strategy}: forward quantized a weight after the load")
    return problems


@pytest.mark.slow  # a spawned pair running every case: `make test` runs it, `make test-fast` not
def test_fp8_param_gather_is_the_same_run_moving_fp8_codes(tmp_path):
    per_rank = run_ranks(_cases, 2, str(tmp_path), timeout=240)
    problems = sorted({p for problems, _ in per_rank for p in problems})
    assert not problems, "\n".join(problems)
    for name, gathered, expected, without, expected_without, amax_reduces, fp8_elements, experts in per_rank[0][1]:
        print(f"{name}: all-gathers {gathered} bytes with the flag, {without} without; FP8 elements {fp8_elements}")
        assert (gathered, without) == (expected, expected_without), (name, gathered, without, expected)
        # the FP8 weights (the experts' too) take 4 bytes an element without the flag (2 in bf16), 1 with it; the
        # MoE model's dense buckets mix more norms in (each payload as long as the longest replica's): 2 and more
        saved = 1 if name.endswith("bf16") else 2 if name.endswith("moe") else 3
        assert "tp2" in name or without - gathered >= saved * fp8_elements, (name, gathered, without)
        assert amax_reduces == 1, name  # one MAX all-reduce of the amaxes per step: over dp, or (dp 1) over tp
        assert experts == (1 if name.endswith("moe") else None), name  # and one of the experts' (per expert)


def _four_ranks(rank, world) -> tuple:
    """The flag against without it on 4 ranks, 3 steps each: ZeRO-3 at dp 2 x pp 2 (1F1B, 2 microbatches a rank),
    dp 2 x pp 2 x vpp 2 (interleaved, 4 layers), dp 2 x cp 2, and the MoE model at dp 4 x ep 2 (ep is carved from
    dp: the experts' replicas are dp / ep = 2) under ZeRO-3, -1 and -2."""
    problems, rows = [], []
    moe = dict(ep=2)
    for recipe, strategy, overlap, layout in (
            ("tensorwise", ZERO3, False, dict(pp=2)), ("delayed", ZERO3, True, dict(pp=2)),
            ("delayed", ZERO3, True, dict(pp=2, vpp=2)), ("tensorwise", ZERO3, True, dict(cp=2)),
            ("delayed", ZERO3, False, dict(cp=2)), ("tensorwise", ZERO3, False, moe), ("delayed", ZERO3, True, moe),
            ("tensorwise", "optim", False, moe), ("delayed", "optim", True, moe),
            ("tensorwise", "optim_grads", True, moe), ("delayed", "optim_grads", False, moe)):
        name = f"{recipe} {strategy} {' '.join(f'{k}{v}' for k, v in layout.items())}{' overlap' if overlap else ''}"
        want = _run(rank, world, _cfg(recipe, strategy, False, overlap, **layout), steps=range(3))
        got = _run(rank, world, _cfg(recipe, strategy, True, overlap, **layout), steps=range(3))
        problems += _same(name, got, want) + _hits(name, got, want, zero3=strategy == ZERO3, steps=3)
        if not got["operands"] or ("ep2" in name) != bool(got["expert_operands"]):
            problems.append(f"{name}: {len(got['operands'])} FP8 weight, {len(got['expert_operands'])} expert "
                            "operands taken")
        rows.append((name, got["gathered"], got["expected"], want["gathered"], want["expected"],
                     got["experts_gathered"], got["experts_expected"], want["experts_gathered"],
                     want["experts_expected"], got["fp8_elements"], got["expert_elements"], got["expert_padded"],
                     got["expert_amax_reduces"]))
    return problems, rows


@pytest.mark.slow  # one spawned group of 4 ranks running every layout
def test_fp8_param_gather_on_4_ranks_zero3_at_pp_vpp_cp_and_moe_ep_under_zero123():
    """Under ZeRO-3 at pp 2 (and interleaved vpp 2), cp 2 and ep 2 (the MoE model), and for the MoE model under
    ZeRO-1 and -2 too, tensorwise and delayed, with and without prefetch (overlapped gathers): the run with the
    flag is the run without it bit for bit (losses, final weights, every FP8 weight operand, each expert's),
    forward takes the gathered codes (ZeRO-3: throughout; ZeRO-1/2: from the second step), and the gathers move
    the analytic bytes: the dense FP8 linears' and the routed experts' weights as codes. The experts' gathers (their
    buffer holds them only) move one byte per expert element and its shard padding, a quarter of the fp32 bytes,
    after one all-reduce of one amax per expert a step."""
    per_rank = run_ranks(_four_ranks, 4, timeout=300)
    problems = sorted({p for problems, _ in per_rank for p in problems})
    assert not problems, "\n".join(problems)
    for rows in (r for _, r in per_rank):
        for (name, gathered, expected, without, expected_without, experts, experts_expected, experts_without,
             experts_expected_without, fp8_elements, expert_elements, expert_padded, expert_amaxes) in rows:
            print(f"{name}: all-gathers {gathered} bytes with the flag, {without} without (experts {experts}, "
                  f"{experts_without}); FP8 elements {fp8_elements}, experts' {expert_elements}")
            assert (gathered, without) == (expected, expected_without), (name, gathered, without, expected)
            # at least 3 bytes saved per FP8 element; under ZeRO-1/2 at dp 4 the dense buckets' mixed payloads (each
            # as long as the longest replica's) save less, 2 and more
            saved = 3 if ZERO3 in name else 2
            assert fp8_elements and without - gathered >= saved * fp8_elements, (name, gathered, without)
            assert (experts, experts_without) == (experts_expected, experts_expected_without), name
            if "ep2" in name:  # one byte an element (and its padding), 4 without the flag
                assert expert_elements and experts == expert_padded and experts_without == 4 * experts, name
                assert expert_amaxes == 1, name
            else:
                assert experts == experts_without == expert_elements == 0 and expert_amaxes is None, name


@pytest.mark.parametrize("flags, words", [
    ([], "nothing runs in FP8"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--use-distributed-optimizer"], "one scale per weight"),
    (["--fp8-format", "e4m3"], "nothing is sharded"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--data-parallel-sharding-strategy",
      "optim_grads_params"], "one scale per weight"),
])
def test_fp8_param_gather_misuse_is_one_line(flags, words):
    with pytest.raises(ConfigError, match=f"--fp8-param-gather True: .*{words}") as err:
        validate(parse_config(["--mock-data", "--fp8-param-gather", *flags]), 2)
    assert len(str(err.value).splitlines()) == 1


def test_fp8_param_gather_is_taken_under_zero3():
    validate(parse_config(["--mock-data", "--fp8-param-gather", "--fp8-format", "e4m3",
                           "--data-parallel-sharding-strategy", "optim_grads_params"]), 2)


def test_codes_whose_delayed_scale_moved_over_a_stale_weight_are_refused():
    """Gathered codes made before the history moved cannot be used, nor can the weight, current on one shard only:
    an error, not stale numbers; once the weight is whole again it is quantized afresh."""
    ctx = ParallelContext()
    layer = ColumnParallelLinear(8, 4, ctx, bias=False)
    lin = Fp8Linear(Recipe("e4m3", "delayed"), layer.weight, ctx)
    fresh = lin.weight_operand(layer.weight)
    lin.gathered = Gathered(fresh, torch.zeros(()), layer.weight._version, lin.weight.steps + 1)
    with pytest.raises(RuntimeError, match="current on this rank's shard only"):
        lin.weight_operand(layer.weight)
    lin.gathered.whole = True
    assert torch.equal(lin.weight_operand(layer.weight).data.view(torch.uint8), fresh.data.view(torch.uint8))


@pytest.mark.parametrize("fmt, margin, dtype", [("e4m3", 0, torch.float32), ("hybrid", 1, torch.bfloat16)])
def test_expert_codes_from_any_shards_are_each_experts_own(fmt, margin, dtype):
    """A stacked expert weight [4, 5, 7] (one expert all zeros) cut into shards at arbitrary places (inside an
    expert, across two, a whole expert and parts of its neighbours, none): the shards' per-expert amaxes combined
    with MAX give each expert's scale, and the shards' codes put together are, per expert, the operand
    Fp8Experts.weight makes (codes, scale, tile), which forward takes while the weight's version holds."""
    from engine.optim.fp8_codes import ExpertCodes
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(4, 5, 7, generator=g) * torch.tensor([1.0, 0.0, 30.0, 1e-3]).view(4, 1, 1)).to(dtype)
    ex = Fp8Experts(Recipe(fmt, "delayed", margin=margin))
    coder, flat = ExpertCodes(ex, w), w.view(-1)
    cuts = [(0, 3), (3, 3), (3, 50), (50, 118), (118, 140)]
    now = torch.stack([coder.amaxes(flat[lo:hi], lo) for lo, hi in cuts]).amax(0)  # the replicas' MAX all-reduce
    scales = coder.scales(now)
    codes = torch.cat([coder.encode(flat[lo:hi], lo, scales) for lo, hi in cuts])
    coder.hand_over(w, codes, now, scales, 0, whole=False)
    assert coder.holds(w)
    for got, want in zip(ex.weights(w, 4), [ex.weight(w[i]) for i in range(4)]):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale_inv, want.scale_inv) and got.scale_inv.shape == want.scale_inv.shape
        assert all(torch.equal(a, b) for a, b in zip(got.tile_of, want.tile_of))
    assert ex.weights(w, 4)[0] is ex.gathered[id(w)].q[0]
    w.mul_(2)  # the weight changed: the codes no longer hold, forward quantizes it
    assert not coder.holds(w) and ex.weights(w, 4)[2].scale_inv == ex.weight(w[2]).scale_inv

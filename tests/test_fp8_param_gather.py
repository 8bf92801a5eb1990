"""`--fp8-param-gather` (engine/optim/fp8_gather.py, fp8_shard.py): the sharded weights' gathers move the FP8
linears' weights as their FP8 codes, and the run is the one without the flag, bit for bit.

At dp 2 (one spawned pair of ranks), `optim` and `optim_grads`, tensorwise and delayed scaling, with the gather at
the end of the step and overlapped with the next forward (and tensorwise at tp 2, delayed with bf16 weights): the
loss curve, the final weights and every FP8 weight operand forward used (codes and scale) equal the run without the
flag, and from the second step on forward takes the gathered codes instead of quantizing. Under ZeRO-3
(`optim_grads_params`: tensorwise, delayed with prefetch, delayed with full recomputation and a skipped update,
tensorwise at tp 2 with prefetch) the unit gathers move the codes and forward takes them from the first step on. The all-gathers move one byte per element of the FP8 weights
in each replica's payload (the analytic count below: per step under ZeRO-1/2, twice a microbatch under ZeRO-3), the
scales cost one all-reduce of a vector a step. A checkpoint saved with the flag after 3 steps (ZeRO-1 and ZeRO-3)
and resumed gives the uninterrupted curve and weights. On 4 ranks (one spawned group), ZeRO-3 with the flag is
the run without it bit for bit at dp 2 x pp 2 (and interleaved vpp 2), dp 2 x cp 2 and, for the MoE model,
dp 4 x ep 2: the dense FP8 linears move codes, the routed experts (engine/fp8/experts.py quantizes them itself)
the run's precision. Misuses are one line each.
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
         recompute: bool = False, pp: int = 1, cp: int = 1, ep: int = 1, vpp: int = 1):
    """The tiny Llama of test_fp8_layouts (its MoE variant under ep > 1; 2 layers a model chunk under vpp)."""
    cfg = _layouts_cfg(recipe, strategy=strategy, tp=tp, pp=pp, cp=cp, ep=ep, moe=ep > 1)
    if vpp > 1:
        cfg.parallel.virtual_pipeline_model_parallel_size, cfg.model.num_layers = vpp, 2 * pp * vpp
    cfg.training.bf16 = bf16
    cfg.model.recompute_granularity = "full" if recompute else None
    cfg.training.fp8_param_gather, cfg.parallel.overlap_param_gather = flag, overlap
    return cfg


class _Spy:
    """Every FP8 weight operand forward takes: (whether it was the gathered codes, codes as bytes, decode scale)."""

    def __init__(self):
        self.seen, self._orig = [], Fp8Linear.weight_operand

    def __enter__(self):
        def spy(lin, weight):
            g = lin.gathered
            hit = g is not None and g.version == weight._version and g.steps == lin.weight.steps
            q = self._orig(lin, weight)
            self.seen.append((hit, q.data.view(torch.uint8).clone(), q.scale_inv.clone()))
            return q
        Fp8Linear.weight_operand = spy
        return self

    def __exit__(self, *exc):
        Fp8Linear.weight_operand = self._orig


def _fp8_weights(chunks) -> set:
    return {id(m.weight) for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "fp8", None), Fp8Linear)}


def _analytic_gather_bytes(opt, fp8_ids: set) -> int:
    """Bytes the step's all-gathers produce: per bucket holding FP8 weights, every replica's payload as long as
    the longest one (one byte per FP8 element, the parameter's size for the others), else the bucket itself."""
    total = 0
    for buffer in opt.buffers:
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
        fp8_ids = _fp8_weights(chunks)
        gathered = sum(r.payload for r in counter.records  # the weights' gathers (not sequence parallelism's)
                       if r.op == "all_gather" and any(r.group is b.group for b in opt.buffers))
        amax_reduces = [r for r in counter.records if r.op == "all_reduce" and r.payload == 4 * len(fp8_ids)]
        experts = opt.expert_buffer if opt.expert_buffer in opt.buffers else None  # their own replicas (ep > 1)
        experts_gathered = sum(r.payload for r in counter.records if r.op == "all_gather" and experts is not None
                               and r.group is experts.group)
        # ZeRO-3 gathers every unit twice a microbatch (forward, backward), ZeRO-1/2 every bucket once a step
        expected = _analytic_gather_bytes(opt, fp8_ids if cfg.training.fp8_param_gather else set()) * (
            2 * _count(ctx) // ctx.dp_size if opt.sharder is not None else 1)
        if save is not None:
            save_checkpoint(save, steps[-1] + 1, chunks, opt, ctx, cfg, {})
        with opt.full_weights():
            weights = {f"{c}.{n}": p.detach().clone() for c, chunk in enumerate(chunks)
                       for n, p in chunk.named_parameters()}
        return dict(losses=losses, weights=weights, operands=spy.seen, gathered=gathered, expected=expected,
                    experts_gathered=experts_gathered,
                    amax_reduces=len(amax_reduces), fp8_elements=sum(p.numel() for b in opt.buffers
                                                                     for p in b.params if id(p) in fp8_ids))
    finally:
        ctx.destroy()


def _same(name, got, want) -> list:
    out = [] if got["losses"] == want["losses"] else [f"{name}: losses {got['losses']} vs {want['losses']}"]
    out += [f"{name}: weight {k} differs" for k in want["weights"] if not torch.equal(got["weights"][k],
                                                                                     want["weights"][k])]
    if len(got["operands"]) != len(want["operands"]) or not all(
            torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(got["operands"], want["operands"])):
        out.append(f"{name}: FP8 weight codes or scales differ")
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
    for recipe, strategy, overlap, tp, bf16, recompute in layouts:
        skip = {2} if recompute else set()
        name = f"{recipe} {strategy}{' overlap' if overlap else ''} tp{tp}{' bf16' if bf16 else ''}" + (
            " recompute skip3" if recompute else "")
        want = _run(rank, world, _cfg(recipe, strategy, False, overlap, tp, bf16, recompute), skip=skip)
        got = _run(rank, world, _cfg(recipe, strategy, True, overlap, tp, bf16, recompute), skip=skip)
        problems += _same(name, got, want) + _hits(name, got, want, strategy == ZERO3, len(skip))
        rows.append((name, got["gathered"], got["expected"] if tp == 1 else 0, want["gathered"],
                     want["expected"] if tp == 1 else 0, got["amax_reduces"], got["fp8_elements"]))
    for strategy in ("optim", ZERO3):
        problems += _resumed(rank, world, _cfg("delayed", strategy, True, overlap=strategy == ZERO3),
                             f"{ckpt}/{strategy}")
    return problems, rows


def _hits(name, got, want, zero3: bool, skipped: int = 0) -> list:
    """Forward takes the gathered codes from the second step on (ZeRO-1/2) but after a skipped update, or always
    (ZeRO-3); never without the flag."""
    hits = sum(h for h, _, _ in got["operands"])
    per_step = len(got["operands"]) // STEPS
    expected = len(got["operands"]) if zero3 else per_step * (STEPS - 1 - skipped)
    if hits != expected or any(h for h, _, _ in want["operands"]):
        return [f"{name}: forward took the gathered codes {hits} times, not {expected}"]
    return []


def _resumed(rank, world, cfg, ckpt) -> list:
    """Saved after 3 steps and resumed: the uninterrupted run's curve and weights."""
    whole = _run(rank, world, cfg)
    _run(rank, world, cfg, save=f"{ckpt}/ck", steps=range(3))
    resumed = _run(rank, world, cfg, load=f"{ckpt}/ck", steps=range(3, STEPS))
    strategy = cfg.parallel.data_parallel_sharding_strategy
    problems = _same(f"resumed {strategy}", dict(resumed, losses=whole["losses"][:3] + resumed["losses"],
                                                 operands=whole["operands"]), whole)
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
    for name, gathered, expected, without, expected_without, amax_reduces, fp8_elements in per_rank[0][1]:
        print(f"{name}: all-gathers {gathered} bytes with the flag, {without} without; FP8 elements {fp8_elements}")
        assert (gathered, without) == (expected, expected_without), (name, gathered, without, expected)
        # the FP8 weights take 4 bytes an element without the flag (2 in bf16), 1 with it
        saved = 1 if name.endswith("bf16") else 3
        assert "tp2" in name or without - gathered >= saved * fp8_elements, (name, gathered, without)
        assert amax_reduces == 1, name  # one MAX all-reduce of the amaxes per step: over dp, or (dp 1) over tp


def _zero3_layouts(rank, world) -> tuple:
    """ZeRO-3 with the flag against without it on 4 ranks, 3 steps each: dp 2 x pp 2 (1F1B, 2 microbatches a
    rank), dp 2 x pp 2 x vpp 2 (interleaved, 4 layers), dp 2 x cp 2, and the MoE model at dp 4 x ep 2 (ep is
    carved from dp: the experts' replicas are dp / ep = 2)."""
    problems, rows = [], []
    for recipe, overlap, layout in (("tensorwise", False, dict(pp=2)), ("delayed", True, dict(pp=2)),
                                    ("delayed", True, dict(pp=2, vpp=2)), ("tensorwise", True, dict(cp=2)),
                                    ("delayed", False, dict(cp=2)), ("tensorwise", False, dict(ep=2)),
                                    ("delayed", True, dict(ep=2))):
        name = f"{recipe} {' '.join(f'{k}{v}' for k, v in layout.items())}{' overlap' if overlap else ''}"
        want = _run(rank, world, _cfg(recipe, ZERO3, False, overlap, **layout), steps=range(3))
        got = _run(rank, world, _cfg(recipe, ZERO3, True, overlap, **layout), steps=range(3))
        problems += _same(name, got, want) + _hits(name, got, want, zero3=True)
        if not got["operands"]:
            problems.append(f"{name}: no FP8 weight operand was taken")
        rows.append((name, got["gathered"], got["expected"], want["gathered"], want["expected"],
                     got["experts_gathered"], want["experts_gathered"], got["fp8_elements"]))
    return problems, rows


@pytest.mark.slow  # one spawned group of 4 ranks running every layout
def test_fp8_param_gather_under_zero3_at_pp_vpp_cp_and_ep():
    """Under ZeRO-3 at pp 2 (and interleaved vpp 2), cp 2 and ep 2 (the MoE model), tensorwise and delayed, with
    and without prefetch: the run with the flag is the run without it bit for bit (losses, final weights, every
    FP8 weight operand), forward takes the gathered codes throughout, and the unit gathers move the analytic
    bytes: the dense FP8 linears' weights as codes, the routed experts' (FP8 through engine/fp8/experts.py, which
    quantizes the whole expert weight itself) in the run's precision, as without the flag."""
    per_rank = run_ranks(_zero3_layouts, 4, timeout=300)
    problems = sorted({p for problems, _ in per_rank for p in problems})
    assert not problems, "\n".join(problems)
    for rows in (r for _, r in per_rank):
        for name, gathered, expected, without, expected_without, experts, experts_without, fp8_elements in rows:
            print(f"{name}: all-gathers {gathered} bytes with the flag, {without} without (experts {experts}, "
                  f"{experts_without}); FP8 elements {fp8_elements}")
            assert (gathered, without) == (expected, expected_without), (name, gathered, without, expected)
            assert fp8_elements and without - gathered >= 3 * fp8_elements, (name, gathered, without)
            assert experts == experts_without and (experts > 0) == ("ep2" in name), (name, experts)


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

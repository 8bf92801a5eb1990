"""The planner's transient allowances for the data-parallel sharding strategies (engine/planner/sharding.py,
`rank_transient_bytes`) against what the engine holds: the most full-size fp32 gradient staging alive at once
under ZeRO-2/3 (GradBuffer.peak_staging_bytes, dense and expert buffers added), the most full-size weights
gathered at once under ZeRO-3 (ParamSharder.peak_gathered_bytes, with and without --overlap-param-gather) and
ZeRO-1/2's all-gather target (with --overlap-param-gather, the padding of the weights' flat buckets, gathered in
place); one training step of two microbatches per rank on 2 gloo ranks (dp 2), with and
without --overlap-grad-reduce, tied and untied, LayerNorm with biases and RMSNorm without, MoE over ep 2; and
at pp 2 (1F1B, interleaved, ZB-H1, ZB-V), where a zero-bubble schedule stages nearly every bucket at once."""
import dataclasses

import pytest
import torch
from test_sharded_dp import MICRO, SEQ, VOCAB, _cfg, _microbatches, _moe

from engine.layout import Layout
from engine.optim import build_optimizer
from engine.parallel.topology import context_for
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from engine.planner.memory import memory_per_gpu
from engine.planner.sharding import rank_buckets, rank_state_bytes, rank_transient_bytes
from harness import run_ranks

M = 2  # microbatches per rank: the second one's backward starts with the first one's last bucket in flight
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def _model(kind: str, strategy: str):
    cfg = _moe(strategy) if kind == "moe" else _cfg(strategy)
    m = cfg.model
    if kind == "untied":
        m.untie_embeddings_and_output_weights = True
    if kind == "rms":  # RMSNorm, RoPE, no biases, SwiGLU, untied: a Llama-shaped model
        m.normalization, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", "rope", True
        m.swiglu, m.untie_embeddings_and_output_weights = True, True
    cfg.training.bf16 = True
    return cfg


def _measure(rank: int, world: int, kind: str, strategy: str, overlap: bool, prefetch: bool, bucket_numel: int):
    """One step on this rank: the engine's transient peaks and its memory_bytes()."""
    cfg = _model(kind, strategy)
    cfg.parallel.overlap_grad_reduce, cfg.parallel.overlap_param_gather = overlap, prefetch
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
    try:
        chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB, dtype=torch.bfloat16)
        opt = build_optimizer(cfg, chunks, ctx, bucket_numel=bucket_numel)
        g = torch.Generator().manual_seed(rank)
        opt.start_step(M)
        for _ in range(M):
            tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
            (opt.scale_loss(chunks[0](tokens[:, :-1], labels=tokens[:, 1:]).mean()) / M).backward()
        opt.finish_grad_sync()
        assert opt.step(1e-4).updated
        gathered = opt.sharder.peak_gathered_bytes if opt.sharder is not None else opt.gather.padding_bytes() \
            if opt.gather is not None else sum(t.numel() * t.element_size() for t in opt._gather_out.values())
        frozen = sum(p.numel() * p.element_size() for p in chunks[0].parameters() if not p.requires_grad)
        memory = opt.memory_bytes()
        steps = sum(4 for group in opt.adam.param_groups for _ in group["params"])  # Adam's fp32 step counts
        state = (memory["params"] + frozen, memory["grads"], memory["optimizer"] - steps)
        return sum(b.peak_staging_bytes for b in opt.buffers), gathered, state
    finally:
        ctx.destroy()


def _all(rank: int, world: int, cases: list) -> list:
    return [_measure(rank, world, *case) for case in cases]


CASES = [(kind, strategy, overlap, prefetch, bucket_numel)
         for kind in ("tied", "untied", "rms", "moe") for strategy in STRATEGIES
         for overlap, prefetch in ((False, False), (True, True))
         for bucket_numel in ((3000, 10_000) if strategy == "optim_grads" else (10_000,))]


@pytest.fixture(scope="module")
def measured():
    per_rank = run_ranks(_all, 2, CASES, timeout=600)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_transient_allowances_equal_the_engine_peaks(measured, case):
    """Staging: the replay of the gradients' order (output weight first, a LayerNorm's weight before its bias,
    positions before words) gives the engine's peak exactly, two microbatches in (the first one's last bucket in
    flight at the second's start with overlap). Gathered: one unit's buckets (two with prefetch), or ZeRO-1/2's
    all-gather target of the largest bucket (with prefetch, the padding of the flat buckets gathered in place).
    Kept state: Optimizer.memory_bytes() exactly."""
    kind, strategy, overlap, prefetch, bucket_numel = case
    cfg = _model(kind, strategy)
    layout = Layout(1, 1, 2, ep=cfg.parallel.expert_model_parallel_size, sharding_strategy=strategy)
    staging, gathered = rank_transient_bytes(cfg.model, layout, "bf16", 0, bucket_numel, overlap, prefetch)
    state = rank_state_bytes(cfg.model, layout, "bf16", 0, bucket_numel)
    ranks = measured[case]
    assert ranks[0][2] == state, (ranks[0][2], state)
    assert max(r[0] for r in ranks) == staging, ([r[0] for r in ranks], staging)
    assert max(r[1] for r in ranks) == gathered, ([r[1] for r in ranks], gathered)
    mem = memory_per_gpu(cfg.model, layout, SEQ, M, bucket_numel=bucket_numel, overlap_grad_reduce=overlap,
                         overlap_param_gather=prefetch)
    assert (mem.staging, mem.gathered) == (staging, gathered)


def _pipeline_staging(rank: int, world: int, strategy: str, schedule, vpp) -> tuple:
    """(pp rank, staging peak) of one step of 8 microbatches at pp 2 (fp32, buckets of 3000 elements)."""
    cfg = _cfg(strategy, pp=2, vpp=vpp, schedule=schedule)
    ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
    try:
        chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB, dtype=torch.float32)
        opt = build_optimizer(cfg, chunks, ctx, bucket_numel=3000)
        runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, MICRO, cfg.model.hidden_size), torch.float32,
                                "cpu")
        microbatches = _microbatches(0)
        opt.start_step(len(microbatches))
        runner.run(microbatches, scale_loss=opt.scale_loss)
        opt.finish_grad_sync()
        opt.step(1e-4)
        return ctx.pp_rank, sum(b.peak_staging_bytes for b in opt.buffers)
    finally:
        ctx.destroy()


PIPELINES = [(s, schedule, vpp) for s in ("optim_grads", "optim_grads_params")
             for schedule, vpp in ((None, None), (None, 2), ("zb-h1", None), ("zb-v", 2))]


def _pipelines(rank: int, world: int) -> list:
    return [_pipeline_staging(rank, world, *case) for case in PIPELINES]


def test_staging_allowance_at_pp_2_and_under_zero_bubble_schedules():
    """pp 2 (dp 1): 1F1B and interleaved stage exactly what the replay says, chunk after chunk; under ZB-H1 and
    ZB-V the weights' gradients wait for the deferred W passes while B passes open the buckets (norms, biases):
    nearly every bucket is staged at once (over 85% of the bytes here), and the allowance is all of them."""
    per_rank = run_ranks(_pipelines, 2, timeout=300)
    for i, (strategy, schedule, vpp) in enumerate(PIPELINES):
        layout = Layout(1, 2, 1, vpp or 1, sharding_strategy=strategy, pipeline_schedule=schedule)
        for pp_rank, peak in (r[i] for r in per_rank):
            allowed = rank_transient_bytes(_cfg(strategy).model, layout, "fp32", pp_rank, 3000)[0]
            if schedule is None:
                assert peak == allowed, (strategy, vpp, pp_rank, peak, allowed)
            else:
                assert 0.85 * allowed <= peak <= allowed, (strategy, schedule, pp_rank, peak, allowed)


def test_llama3_8b_staging_and_gathering_by_hand():
    """Llama 3 8B (untied, 40M-element buckets) at pp 2, dp 8, ZeRO-2: the last stage's output weight is laid out
    first (forward order reversed), in a bucket of its own (525M elements), and gets its gradient first, so
    that bucket is reduced and freed before any other opens; every stage stages one bucket at a time (the
    largest: the output's, the word embedding's), and with --overlap-grad-reduce one more in flight.
    ZeRO-3 stages and gathers one unit (a layer or the embedding), two with overlap / prefetch; a zero-bubble
    schedule may keep every bucket open from B to W."""
    import os

    from engine.cli import parse_config
    from engine.planner.sharding import rank_buckets, rank_chunks
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = parse_config(["--config", os.path.join(root, "configs", "llama3-8b.yaml")]).model
    vocab, fc1 = model.padded_vocab_size(1) * model.hidden_size, 2 * model.resolved_ffn_hidden_size() * 4096
    lay = Layout(1, 2, 8, sharding_strategy="optim_grads")
    last = rank_chunks(model, lay, 1)[0].buckets
    assert last[0] == (vocab, vocab) and max(p for _, p in last[1:]) == fc1
    assert rank_transient_bytes(model, lay, "bf16", 1) == (4 * vocab, 2 * vocab)
    first = [p for _, p in rank_buckets(model, lay, 0)]
    assert rank_transient_bytes(model, lay, "bf16", 0)[0] == 4 * max(first) == 4 * (vocab + 4096)
    staged = rank_transient_bytes(model, lay, "bf16", 0, overlap_grad_reduce=True)[0]
    assert 4 * max(first) < staged <= 8 * max(first)
    z3 = dataclasses.replace(lay, sharding_strategy="optim_grads_params")
    unit = [p for _, p in rank_buckets(model, z3, 0)]
    assert unit[0] == 218_112_000 and max(unit) == vocab  # a layer (padded to 64 x 8), the embedding
    assert rank_transient_bytes(model, z3, "bf16", 0) == (4 * vocab, 2 * vocab)
    both = rank_transient_bytes(model, z3, "bf16", 0, overlap_grad_reduce=True, overlap_param_gather=True)
    assert both == (4 * (vocab + unit[0]), 2 * (vocab + unit[0]))  # the embedding's and a layer's
    zb = dataclasses.replace(lay, pipeline_schedule="zb-h1")
    assert rank_transient_bytes(model, zb, "bf16", 0)[0] == 4 * sum(first)


def _fp8_cfg(kind: str, strategy: str, bf16: bool, tp: int = 1, pp: int = 1, ep: int = 1):
    """A tiny model with --fp8-param-gather: test_fp8_param_gather's Llama (dense or MoE), tied with LayerNorm,
    biases and learned positions, or the DeepSeek-V3-shaped one (MLA's replicated latents, shared expert, MTP)."""
    if kind == "deepseek":
        import os

        from engine.cli import parse_config
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cfg = parse_config(["--config", os.path.join(root, "configs", "deepseek-v3-tiny.yaml"), "--fp8-format",
                            "hybrid", "--fp8-recipe", "delayed", "--data-parallel-sharding-strategy", strategy])
        par = cfg.parallel
        par.tensor_model_parallel_size, par.pipeline_model_parallel_size = tp, pp
        par.expert_model_parallel_size, par.sequence_parallel = ep, tp > 1
    else:
        from test_fp8_layouts import _cfg as fp8_cfg
        cfg = fp8_cfg("tensorwise", tp=tp, pp=pp, ep=ep, strategy=strategy, moe=kind == "moe")
        cfg.model.vocab_size = 96
        if kind == "gpt":
            m = cfg.model
            m.untie_embeddings_and_output_weights, m.normalization, m.disable_bias_linear = False, "LayerNorm", False
            m.position_embedding_type, m.swiglu = "learned_absolute", False
    cfg.training.fp8_param_gather, cfg.training.bf16 = True, bf16
    return cfg


def _engine_fp8_gather(cfg, layout, pp_rank: int, dp_rank: int, bucket_numel: int) -> tuple:
    """The engine's (gathered, the experts' part of it, payloads, codes, FP8 linears' weights, routed experts) on
    one replica, built on a virtual context. ZeRO-1/2: the all-gathers' bytes as test_fp8_param_gather counts them
    (equal there to what comm.counting measures), the payloads of Fp8Gather's plans, its codes. ZeRO-3: one pass
    of the unit gathers (`_unit_gather_bytes`), the payloads Fp8Shard keeps (`_mine`), the bytes its code tensors
    hold between steps (none: freed with their units). Both: the linears' weights whose amaxes the dense buffer
    all-reduces, one each, and the experts of the stacked expert weights, one amax each over the experts'
    replicas."""
    from test_fp8_param_gather import _analytic_gather_bytes, _expert_weights, _fp8_weights, _linear_weights

    from engine.parallel.topology import ParallelContext
    ctx = ParallelContext.virtual(layout=layout, pp_rank=pp_rank, dp_rank=dp_rank)
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size,
                                dtype=torch.bfloat16 if cfg.training.bf16 else torch.float32)
    opt = build_optimizer(cfg, chunks, ctx, bucket_numel=bucket_numel)
    weights, stacks = _fp8_weights(chunks), _expert_weights(chunks)
    amaxes = (len(_linear_weights(chunks)), sum(p.shape[0] for p in stacks))
    experts = [opt.expert_buffer] if opt.expert_buffer in opt.buffers else []
    if opt.sharder is not None:
        shard = opt.sharder.fp8
        held = sum(c.untyped_storage().nbytes() for c in shard._codes.values())
        assert sorted(shard._at) == sorted(weights)
        return (_unit_gather_bytes(opt.sharder), _unit_gather_bytes(opt.sharder, experts),
                sum(t.numel() for t in shard._mine.values()), held, *amaxes)
    payloads = sum(size * opt.buffers[i].replicas for (i, _), (_, size) in opt.fp8._plans.items())
    return (_analytic_gather_bytes(opt, weights), _analytic_gather_bytes(opt, weights, experts), payloads,
            sum(c.numel() for c in opt.fp8.codes.values()), *amaxes)


def _unit_gather_bytes(sharder, buffers=None) -> int:
    """Bytes one pass of ZeRO-3's unit gathers produces (param_shard.ParamSharder: every unit of every chunk once,
    a bucket with each unit holding it; of `buffers`' buckets, default all): a bucket holding FP8 weights its
    replicas' payloads (Fp8Shard's plan), another its flat tensor in the run's precision."""
    fp8 = sharder.fp8
    return sum(s.buffer.replicas * fp8._plans[id(s)][1] if fp8.covers(s) else s.flat.numel() * s.flat.element_size()
               for units in sharder.chunks for u in units for s in u.buckets
               if buffers is None or any(s.buffer is b for b in buffers))


FP8_CASES = [("llama", "optim", False, 2, {}, 3000), ("llama", "optim_grads", True, 2, {}, 1000),
             ("llama", "optim", True, 4, {}, 700), ("llama", "optim", False, 4, dict(tp=2), 2000),
             ("llama", "optim_grads", True, 4, dict(pp=2), 900), ("gpt", "optim", True, 4, {}, 1100),
             ("moe", "optim", True, 4, dict(ep=2), 1500), ("deepseek", "optim_grads", True, 4, dict(ep=2), 5000),
             ("deepseek", "optim", False, 4, dict(tp=2, pp=2), 3000),
             # ZeRO-3: the unit gathers (the tied embedding's bucket twice at pp 1); MLA, MTP and experts
             ("gpt", "optim_grads_params", True, 4, dict(pp=2), 3000),
             ("deepseek", "optim_grads_params", False, 4, dict(ep=2), 5000)]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "-".join(map(str, c[:4] + tuple(c[4].items()))))
def test_fp8_param_gather_bytes_equal_the_engines(case):
    """engine/planner/fp8_gather.py against the engine's optimizer built on every replica of every pipeline rank:
    the step's all-gather bytes (the FP8 linears' and routed experts' weights one byte an element in each
    replica's payload, every payload as long as the bucket's longest; the other buckets in the run's precision;
    under ZeRO-3 one pass of unit gathers), the experts' buffer's part of them, the payloads and codes kept, the
    amaxes all-reduced (one per linear's weight, one per expert); Memory.fp8_gather is their sum (and ZeRO-3's
    transient) on the busiest rank. Llama fp32 at dp 2 gathers 57,088 bytes: what test_fp8_param_gather
    measures with comm.counting; ZeRO-3's step and transient are measured below."""
    from engine.planner.fp8_gather import fp8_gather_bytes
    kind, strategy, bf16, world, degrees, bucket_numel = case
    cfg = _fp8_cfg(kind, strategy, bf16, **degrees)
    layout, precision = Layout.from_config(cfg, world), "bf16" if bf16 else "fp32"
    for pp_rank in range(layout.pp):
        planned = fp8_gather_bytes(cfg.model, layout, precision, pp_rank, bucket_numel)
        want = (planned.gathered + planned.experts_gathered, planned.experts_gathered, planned.payloads,
                planned.codes, planned.weights, planned.expert_amaxes)
        for dp_rank in range(layout.dp):
            assert _engine_fp8_gather(cfg, layout, pp_rank, dp_rank, bucket_numel) == want, (pp_rank, dp_rank, want)
        assert planned.weights > 0 and planned.codes < planned.payloads <= planned.gathered + planned.experts_gathered
        # the experts' buffer holds their FP8 weights only: one byte an element of each padded bucket a pass
        experts = sum(p for _, p in rank_buckets(cfg.model, layout, pp_rank, True, bucket_numel)) \
            if cfg.model.num_experts else 0
        assert planned.experts_gathered == experts and (planned.expert_amaxes > 0) == (experts > 0)
    if case == FP8_CASES[0]:
        assert planned.gathered == 57_088
    if layout.pp == 1:
        mem = memory_per_gpu(cfg.model, layout, SEQ, M, precision, bucket_numel=bucket_numel, fp8_param_gather=True)
        assert mem.fp8_gather == planned.codes + planned.payloads + planned.transient
    assert (planned.transient > 0) == layout.sharding.params


def _fp8_zero3_step(rank: int, world: int, cases: list) -> list:
    """Per case, one step of M microbatches under ZeRO-3 with --fp8-param-gather: (the bytes the weights'
    all-gathers produced, by comm.counting; Fp8Shard.peak_bytes; what it holds after the step)."""
    from engine import fp8
    from engine.parallel import comm
    out = []
    for kind, bf16, prefetch in cases:
        cfg = _fp8_cfg(kind, "optim_grads_params", bf16)
        cfg.parallel.overlap_param_gather = prefetch
        ctx = context_for(Layout.from_config(cfg, world), rank, seed=cfg.training.seed)
        try:
            chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size,
                                        dtype=torch.bfloat16 if bf16 else torch.float32)
            opt = build_optimizer(cfg, chunks, ctx)
            g, seq = torch.Generator().manual_seed(rank), cfg.model.seq_length
            with comm.counting() as counter:
                opt.start_step(M)
                for _ in range(M):
                    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=g)
                    (opt.scale_loss(chunks[0](tokens[:, :-1], labels=tokens[:, 1:]).mean()) / M).backward()
                opt.finish_grad_sync()
                fp8.finish_step(chunks, ctx)
                assert opt.step(1e-4).updated
            gathered = sum(r.payload for r in counter.records
                           if r.op == "all_gather" and any(r.group is b.group for b in opt.buffers))
            out.append((gathered, opt.sharder.fp8.peak_bytes, opt.sharder.fp8.held_bytes))
        finally:
            ctx.destroy()
    return out


ZERO3_FP8_STEPS = [("gpt", True, False), ("llama", False, True), ("moe", True, True)]


def test_fp8_param_gather_under_zero3_equals_the_engines_step():
    """One step of M microbatches at dp 2 under ZeRO-3 with --fp8-param-gather, tied GPT in bf16 (the embedding's
    bucket gathered with the embedding and with the head), Llama in fp32 and the MoE Llama in bf16 (each layer's
    dense bucket and its experts' landing in turn) with --overlap-param-gather: the weights' all-gathers produce
    2 M passes of the planner's unit gathers (comm.counting: 151,040 bytes for the GPT), and the most code tensors
    and gathered payloads held at once (Fp8Shard.peak_bytes) is the planner's transient, none left after the
    step."""
    from engine.planner.fp8_gather import fp8_gather_bytes
    per_rank = run_ranks(_fp8_zero3_step, 2, ZERO3_FP8_STEPS, timeout=120)
    for i, (kind, bf16, prefetch) in enumerate(ZERO3_FP8_STEPS):
        cfg = _fp8_cfg(kind, "optim_grads_params", bf16)
        layout, precision = Layout.from_config(cfg, 2), "bf16" if bf16 else "fp32"
        planned = fp8_gather_bytes(cfg.model, layout, precision, 0, prefetch=prefetch)
        for gathered, peak, held in (r[i] for r in per_rank):
            passes = 2 * M * (planned.gathered + planned.experts_gathered)  # (ep 1: the experts' over dp too)
            assert (gathered, peak, held) == (passes, planned.transient, 0), (kind, planned)
        # a unit's payloads are freed as it lands, before its neighbour's gather is launched: with equal layers of
        # one FP8 bucket each prefetch holds one layer's codes and payloads at most, as without it; an MoE layer
        # lands its dense bucket while its experts' payloads are still held, and prefetch holds all of a layer's
        # codes beside the next one's payloads, more
        other = fp8_gather_bytes(cfg.model, layout, precision, 0, prefetch=not prefetch).transient
        assert other == planned.transient if kind != "moe" else other < planned.transient, (kind, other)
        mem = memory_per_gpu(cfg.model, layout, cfg.model.seq_length, M, precision, overlap_param_gather=prefetch,
                             fp8_param_gather=True)
        assert mem.fp8_gather == planned.payloads + planned.transient
        if kind == "gpt":  # each bucket once a pass would be 126,464: the word embedding's 6,144 go twice
            assert 2 * M * planned.gathered == 151_040


def test_fp8_payload_rounds_up_to_whole_elements():
    """A bucket of 10 fp32 elements over 2 replicas, FP8 weights at [0, 3) and [5, 10): replica 0's payload is 3
    code bytes and 2 elements of 4 bytes (11, rounded up to 12), replica 1's 5 code bytes; a replica holding
    only other parameters' elements sends them whole."""
    from engine.planner.fp8_gather import _longest_payload
    assert _longest_payload(10, 5, ((0, 3), (5, 10)), 4) == 12
    assert _longest_payload(10, 5, ((0, 5),), 4) == 20
    assert _longest_payload(7, 5, ((0, 5),), 2) == 6  # replica 0: 5 code bytes, over replica 1's 2 x 2
    assert _longest_payload(10, 5, ((0, 10),), 4) == 8  # FP8 only: 5 bytes, rounded up


def test_fp8_param_gather_prices_llama3_8b():
    """Llama 3 8B in bf16 at dp 8, ZeRO-1, delayed scaling: the FP8 linears (all but the embedding, the output
    layer and the norms: 87% of the weights) gather one byte an element, so the all-gather moves 1 x F + 2 x
    (P - F) bytes within 0.05% (each payload of a bucket that mixes a norm in is as long as the norm's replica's,
    and shard padding), and the step's exposed gather shrinks by the
    ring time of the bytes saved (the amax all-reduce's latency aside); the codes and the payloads keep about
    two bytes per FP8 element. Under ZeRO-3 each of the 2 m passes of unit gathers moves about those bytes (the
    unit buckets' padding aside), the same ring time saved each, outside the 30% FSDP overlap hides; each rank
    keeps its own payloads (an eighth of a byte an FP8 element at dp 8) and holds one layer's codes and payloads
    while it is gathered. No change where the engine refuses the flag (no_shard, blockwise)."""
    import os

    from engine.cli import parse_config
    from engine.flops import GPU_PRESETS
    from engine.planner.fp8_gather import fp8_gather_bytes
    from engine.planner.links import group_links
    from engine.planner.params import params_per_rank
    from engine.planner.software import Software
    from engine.planner.step_time import estimate
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = parse_config(["--config", os.path.join(root, "configs", "llama3-8b.yaml")]).model
    gpu, lay = GPU_PRESETS["h100-sxm"], Layout(dp=8, sharding_strategy="optim")
    b, P = fp8_gather_bytes(model, lay, "bf16", 0), params_per_rank(model, lay)[0]
    assert 0.86 < b.codes / P < 0.88 and b.gathered == pytest.approx(b.codes + 2 * (P - b.codes), rel=5e-4)

    def run(layout, recipe="delayed", flag=True):
        return estimate(model, layout, gpu, 64, 8192, software=Software(overlap_grad_reduce=False, fp8=recipe,
                                                                        fp8_param_gather=flag))
    got, base = run(lay), run(lay, flag=False)
    link = group_links(lay, gpu, 8).dp
    saved = 7 / 8 * (link.seconds(2 * P - b.gathered) - link.latency)
    assert base.breakdown["dp_comm"] - got.breakdown["dp_comm"] == pytest.approx(saved, rel=1e-2)
    assert got.memory.fp8_gather == b.codes + b.payloads == pytest.approx(2 * b.codes, rel=1e-3)
    # without the flag the weights are held quantized for the step instead (fp8_held_bytes): 2 bytes an element
    assert base.memory.fp8_held == 2 * b.codes and got.memory.fp8_held == 0
    assert got.memory.allocated - base.memory.allocated == got.memory.fp8_gather - base.memory.fp8_held
    for layout, recipe in ((lay, "blockwise"), (Layout(dp=8), "delayed")):
        assert run(layout, recipe) == run(layout, recipe, flag=False), (layout.sharding_strategy, recipe)
    from engine.planner.step_time import FSDP_HIDDEN_FRACTION
    z3 = Layout(dp=8, sharding_strategy="optim_grads_params")
    b3, m = fp8_gather_bytes(model, z3, "bf16", 0), 64 // 8
    assert b3.gathered == pytest.approx(b.gathered, rel=5e-4) and b3.codes == 0
    got, base = run(z3), run(z3, flag=False)
    saved = 2 * m * (1 - FSDP_HIDDEN_FRACTION) * 7 / 8 * (link.seconds(2 * P - b3.gathered) - link.latency)
    assert base.breakdown["dp_comm"] - got.breakdown["dp_comm"] == pytest.approx(saved, rel=1e-2)
    assert b3.payloads == pytest.approx(b.payloads / 8, rel=1e-3)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # QKV, projection, MLP: a layer's codes
    assert b3.transient == pytest.approx(2 * layer, rel=1e-3)
    assert got.memory.fp8_gather == b3.payloads + b3.transient
    assert got.memory.allocated - base.memory.allocated == got.memory.fp8_gather  # ZeRO-3 holds no weight
    assert base.memory.fp8_held == got.memory.fp8_held == 0


def test_fp8_param_gather_prices_the_experts_gathers():
    """Mixtral 8x7B in bf16 at dp 8 x ep 4, ZeRO-1, delayed scaling: the routed experts (88% of a rank's weights)
    gather one byte an element too, over their own 2 replicas (11.27e9 bytes, their element count: the buckets hold
    nothing else), after one all-reduce of one amax per expert (2 local experts x 2 stacked weights x 32 layers);
    the step's exposed gather shrinks by the ring time of the dense and the experts' bytes saved, less the two
    amax all-reduces'."""
    import os

    from engine.cli import parse_config
    from engine.flops import GPU_PRESETS
    from engine.planner.fp8_gather import fp8_gather_bytes
    from engine.planner.links import all_reduce, group_links
    from engine.planner.params import param_split_per_rank
    from engine.planner.software import Software
    from engine.planner.step_time import estimate
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = parse_config(["--config", os.path.join(root, "configs", "mixtral-8x7b.yaml")]).model
    gpu, lay = GPU_PRESETS["h100-sxm"], Layout(dp=8, ep=4, sharding_strategy="optim")
    b, (P, E, _) = fp8_gather_bytes(model, lay, "bf16", 0), param_split_per_rank(model, lay)[0]
    assert b.experts_gathered == E and b.expert_amaxes == 2 * 2 * model.num_layers and E > 7 * P
    assert E + 0.8 * P < b.codes < E + 0.85 * P  # the experts' codes and the dense FP8 linears' (84%: not the
    #                                              embedding, the output layer, the router or the norms)

    def run(flag):
        return estimate(model, lay, gpu, 64, 4096, software=Software(overlap_grad_reduce=False, fp8="delayed",
                                                                     fp8_param_gather=flag))
    links = group_links(lay, gpu, 8)
    saved = (7 / 8 * (links.dp.seconds(2 * P - b.gathered) - links.dp.latency)
             + 1 / 2 * (links.edp.seconds(2 * E - b.experts_gathered) - links.edp.latency)
             - all_reduce(4 * b.weights, 8, links.dp) - all_reduce(4 * b.expert_amaxes, 2, links.edp))
    got, base = run(True), run(False)
    assert base.breakdown["dp_comm"] - got.breakdown["dp_comm"] == pytest.approx(saved, rel=1e-9)
    assert got.memory.fp8_gather == b.codes + b.payloads


def test_one_replica_publishes_without_a_gather_target():
    """With one data-parallel replica (the distributed optimizer on one GPU, as gpu-check's training runs) every
    master is this rank's and goes straight into its weight: no all-gather target is allocated, and the planner
    counts none; the MoE experts' buffer at ep 2 on 2 ranks (one replica each) is covered by the cases above."""
    results = run_ranks(_all, 1, [("rms", "optim", False, False, 10_000), ("tied", "optim_grads", False, False, 3000)],
                        timeout=120)[0]
    for (_, gathered, _), (kind, strategy) in zip(results, (("rms", "optim"), ("tied", "optim_grads"))):
        cfg = _model(kind, strategy)
        layout = Layout(1, 1, 1, sharding_strategy=strategy)
        assert gathered == 0 == rank_transient_bytes(cfg.model, layout, "bf16", 0)[1]

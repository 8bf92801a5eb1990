"""The planner's memory model against the engine: exact parameter counts (meta-device build), the paper's
activation formulas, weights, gradients and optimizer state as engine/optim allocates them for every
data-parallel sharding strategy (bucket padding included), the ZeRO formulas checked by hand, the zero-bubble
schedules' activation peaks, activations against benchmarks/memory.py's measurement, and mixture-of-experts
counts. (Split from tests/test_find_parallelism.py: the CLI is tested there, the published runs in
tests/test_planner_calibration.py.)"""
import os
from dataclasses import replace as dataclasses_replace

import numpy as np
import pytest
import torch

from engine.cli import parse_config
from engine.layout import Layout, PipelineSchedule
from engine.pipeline.schedules import peak_in_flight
from engine.planner.activations import layer_activation_bytes
from engine.planner.memory import memory_per_gpu, state_bytes
from engine.planner.params import param_split_per_rank, params_per_rank
from engine.planner.published import gpt
from engine.planner.search import uneven_split
from engine.planner.stages import stage_layer_ids
from engine.planner.verify import meta_params_per_rank
from engine.validation import validate
from planner_common import CONFIGS, ROOT

# --- parameters: analytic == what the engine builds --------------------------------------------

def _layouts_for(cfg):
    yield Layout.from_config(cfg, cfg.tp * cfg.pp * cfg.cp)
    m = cfg.model
    groups = m.resolved_query_groups()
    for tp, pp in ((1, 1), (2, 2), (4, 4)):
        if groups % tp == 0 and m.num_attention_heads % tp == 0 and m.resolved_ffn_hidden_size() % tp == 0:
            if m.num_layers % pp == 0:
                yield Layout(tp, pp, 1, 2 if m.num_layers % (2 * pp) == 0 and pp > 1 else 1)
            elif uneven_split(m.num_layers, pp):
                first, last = uneven_split(m.num_layers, pp)
                yield Layout(tp, pp, 1, first_stage_layers=first, last_stage_layers=last)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_param_counts_equal_meta_device_model(path):
    cfg = parse_config(["--config", path])
    if not cfg.data.mock_data and not cfg.data.data_path:
        cfg.data.mock_data = True
    for layout in _layouts_for(cfg):
        assert params_per_rank(cfg.model, layout) == meta_params_per_rank(cfg, layout), (path, layout)


def test_uneven_split_is_valid_and_counted_exactly():
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama3-1b.yaml"), "--num-layers", "15"])
    first, last = uneven_split(15, 4)
    assert first + last + 2 * 4 == 15
    cfg.parallel.pipeline_model_parallel_size = 4
    cfg.parallel.decoder_first_pipeline_num_layers, cfg.parallel.decoder_last_pipeline_num_layers = first, last
    validate(cfg, 4)
    layout = Layout(1, 4, 1, first_stage_layers=first, last_stage_layers=last)
    assert params_per_rank(cfg.model, layout) == meta_params_per_rank(cfg, layout)


# --- activations: Korthikanti et al. 2022, Table 2 --------------------------------------------

@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (2048, 4, 6144, 64, 8), (4096, 2, 4096, 32, 4)])
def test_activation_formulas_reproduce_table_2(s, b, h, a, t):
    m = gpt(1, h, a, seq=s)
    act = lambda **kw: layer_activation_bytes(m, s, b, **kw)  # noqa: E731
    sbh = s * b * h
    assert act() == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert act(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert act(tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(sbh / t * 34)
    assert act(tp=t, recompute="full") == pytest.approx(2 * sbh)
    assert act(tp=t, sequence_parallel=True, flash_attention=True) == pytest.approx(sbh / t * 34)


def test_microbatches_in_flight():
    # 1F1B: rank r holds pp - r microbatches; interleaved rank 0 holds Korthikanti's L(1 + (p-1)/(pv)) layers.
    assert [peak_in_flight(PipelineSchedule.of(None, 4), r, 64) for r in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(PipelineSchedule.of(None, 4), 0, 2) == 2
    p, v, L = 8, 3, 96
    layers_held = peak_in_flight(PipelineSchedule.of(None, p, v), 0, 64) * L / (p * v)
    assert layers_held == pytest.approx(L * (1 + (p - 1) / (p * v)))
    m = gpt(96, 12288, 96)
    mem = memory_per_gpu(m, Layout(8, 8, 1, 3, 1, "selective", True), 2048, 64, flash_attention=False)
    assert mem.rank == 0
    assert mem.activations == pytest.approx(layers_held * 34 * 2048 * 12288 / 8)


# --- weights, gradients and optimizer state: what engine/optim really allocates -------------------

def _engine_state_bytes(cfg, layout, pp_rank, dp_rank):
    from engine.optim import adamw, build_optimizer
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    ctx = ParallelContext.virtual(layout=layout, pp_rank=pp_rank, dp_rank=dp_rank)
    cfg.parallel.use_distributed_optimizer = layout.distributed_optimizer
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float32
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="meta", dtype=dtype)
    opt = build_optimizer(cfg, chunks, ctx)
    params = {id(p): p for c in chunks for p in c.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = opt.buffer.data.numel() * opt.buffer.data.element_size()
    steps = sum(t.numel() * t.element_size() for t in adamw.state_tensors(opt.adam) if t.dim() == 0)
    return weights, grads, opt.state_bytes() - steps, len(opt.buffer.buckets)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_state_bytes_equal_engine_allocations(precision):
    argv = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--swiglu", "--vocab-size", "300", "--seq-length", "32", "--mock-data"]
    cfg = parse_config(argv + (["--bf16"] if precision == "bf16" else []))
    for dist in (False, True):
        for tp, pp, dp, vpp in ((1, 1, 1, 1), (2, 2, 2, 1), (1, 2, 4, 2)):
            layout = Layout(tp, pp, dp, vpp, distributed_optimizer=dist)
            for r, n in enumerate(params_per_rank(cfg.model, layout)):
                w, g, o = state_bytes(n, layout, precision)
                opt_total = 0
                for d in range(dp):
                    ew, eg, eo, buckets = _engine_state_bytes(cfg, layout, r, d)
                    assert ew == w
                    pad = 64 * dp * buckets if dist and dp > 1 else 0  # shard alignment, elements
                    assert 0 <= eg - g <= 4 * pad
                    assert abs(eo - o) <= 12 * pad
                    opt_total += eo
                assert opt_total == pytest.approx(o * dp), (layout, r)



# --- on a GPU: predicted peak against the allocator ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU in this session")
def test_predicted_peak_memory_single_rank_within_15_percent():
    from engine.optim import build_optimizer
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama3-1b.yaml"), "--num-layers", "8",
                        "--seq-length", "2048", "--micro-batch-size", "2", "--tp", "1", "--pp", "1"])
    cfg.parallel.use_distributed_optimizer = False
    ctx = ParallelContext.virtual()
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="cuda", dtype=torch.bfloat16)
    opt = build_optimizer(cfg, chunks, ctx)
    model, micro, s, steps = chunks[0], 2, 2048, 4
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        opt.start_step(steps)
        for _ in range(steps):
            tokens = torch.randint(0, cfg.model.vocab_size, (micro, s + 1), device="cuda", generator=g)
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            (opt.scale_loss(loss) / steps).backward()
        opt.finish_grad_sync()
        opt.step(1e-4)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = memory_per_gpu(cfg.model, Layout(micro_batch_size=micro), s, steps, "bf16", True).allocated
    assert abs(predicted - measured) / measured <= 0.15, (predicted / 2 ** 30, measured / 2 ** 30)



def test_activation_bytes_per_rank_halve_at_cp_2():
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama3-8b-128k.yaml")])
    m = cfg.model
    one = layer_activation_bytes(m, 131072, 1, 2, True, "none", True, cp=1)
    two = layer_activation_bytes(m, 131072, 1, 2, True, "none", True, cp=2)
    assert two == pytest.approx(one / 2, rel=1e-9)
    mem1 = memory_per_gpu(m, Layout(2, 1, 4, sequence_parallel=True, cp=1), 131072, 8)
    mem2 = memory_per_gpu(m, Layout(2, 1, 2, sequence_parallel=True, cp=2), 131072, 8)
    assert mem2.activations == pytest.approx(mem1.activations / 2, rel=0.01)
    assert mem2.logits == pytest.approx(mem1.logits / 2)



def test_optimizer_state_shards_over_dp_times_cp():
    w, g, o = state_bytes(1_000_000, Layout(dp=2, cp=4, distributed_optimizer=True), "bf16")
    assert (w, g, o) == (2_000_000, 4_000_000, 12_000_000 / 8)



# --- activations against benchmarks/memory.py's measurement ---------------------------------------

@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_within_10_percent_of_measured(recompute):
    """benchmarks/memory.py measures what one Llama-shaped layer saves for backward (fp32, tp 1); the
    planner's term (the published formula in 2-byte units, its dropout masks kept as a margin) scaled to
    fp32 is within 10%: +6% without and with selective recomputation, -3% with full."""
    import importlib.util

    from engine.parallel.topology import ParallelContext
    spec = importlib.util.spec_from_file_location("benchmarks_memory", os.path.join(ROOT, "benchmarks", "memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = bench.llama_config(recompute)
    measured, _, _ = bench.measure(cfg, ParallelContext.virtual(), torch.device("cpu"))
    planned = 2 * layer_activation_bytes(cfg, bench.SEQ, bench.MICRO, 1, False, recompute, flash_attention=True)
    assert abs(planned - measured) / measured <= 0.10, (recompute, planned, measured)



# --- mixture of experts: expert parallelism, activated FLOPs, all-to-all ---------------------------

MOE_ARGV = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--swiglu", "--vocab-size", "300", "--seq-length", "32", "--mock-data", "--num-experts", "8",
            "--moe-layer-freq", "[0]*1+[1]*3", "--moe-ffn-hidden-size", "48",
            "--moe-shared-expert-intermediate-size", "32", "--moe-router-enable-expert-bias"]


@pytest.mark.parametrize("layout", [Layout(1, 1, 1), Layout(1, 1, 4, ep=4), Layout(2, 2, 2, 2, sequence_parallel=True, ep=2),
                                    Layout(2, 4, 8, sequence_parallel=True, ep=8)],
                         ids=lambda lay: f"tp{lay.tp}-pp{lay.pp}-vpp{lay.vpp}-ep{lay.ep}")
def test_moe_param_counts_equal_meta_device_model_at_every_ep(layout):
    """Dense first layer, biases, a shared expert and the fp32 expert bias: the analytic count per rank equals the
    model built on the meta device, experts split over ep (E/ep per rank) and replicated over tp."""
    cfg = parse_config(MOE_ARGV)
    assert params_per_rank(cfg.model, layout) == meta_params_per_rank(cfg, layout)
    if layout.ep > 1:
        one = params_per_rank(cfg.model, dataclasses_replace(layout, ep=1))
        experts = 3 * 8 * 64 * 48 * (1 - 1 / layout.ep)  # a layer's routed experts less this rank's share
        moe_per_rank = [sum(i in (1, 2, 3) for chunk in chunks for i in chunk) for chunks in stage_layer_ids(4, layout)]
        assert [a - b for a, b in zip(one, params_per_rank(cfg.model, layout))] == [n * experts for n in moe_per_rank]


def test_mixtral_meta_build_at_ep_8_matches_the_analytic_count():
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "mixtral-8x7b.yaml")])
    layout = Layout(2, 4, 8, sequence_parallel=True, ep=8)
    assert params_per_rank(cfg.model, layout) == meta_params_per_rank(cfg, layout)


def _engine_moe_state_bytes(cfg, layout, pp_rank, dp_rank):
    """Weights, gradient buffers (dense and expert) and optimizer state one rank allocates."""
    from engine.optim import adamw, build_optimizer
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    ctx = ParallelContext.virtual(layout=layout, pp_rank=pp_rank, dp_rank=dp_rank)
    cfg.parallel.use_distributed_optimizer = layout.distributed_optimizer
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="meta", dtype=torch.bfloat16)
    opt = build_optimizer(cfg, chunks, ctx)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for c in chunks for p in c.parameters()}.values())
    grads = sum(b.data.numel() * b.data.element_size() for b in opt.buffers)
    steps = sum(t.numel() * t.element_size() for t in adamw.state_tensors(opt.adam) if t.dim() == 0)
    pad = sum(64 * b.replicas * len(b.buckets) for b in opt.buffers) if layout.distributed_optimizer else 0
    return weights, grads, opt.state_bytes() - steps, pad


@pytest.mark.parametrize("dist", [False, True])
def test_moe_state_bytes_equal_engine_allocations(dist):
    """bf16 weights (the expert bias fp32), fp32 gradients of dense and expert parameters, and optimizer state
    sharded over dp x cp for dense and dp/ep x cp for experts: what engine/optim allocates, summed over dp."""
    cfg = parse_config(MOE_ARGV + ["--bf16"])
    for layout in (Layout(1, 1, 4, ep=2, distributed_optimizer=dist),
                   Layout(2, 2, 4, sequence_parallel=True, ep=4, distributed_optimizer=dist)):
        for r, (dense, experts, frozen) in enumerate(param_split_per_rank(cfg.model, layout)):
            w, g, o = state_bytes(dense, layout, "bf16", experts, frozen)
            opt_total = 0
            for d in range(layout.dp):
                ew, eg, eo, pad = _engine_moe_state_bytes(cfg, layout, r, d)
                assert ew == w and 0 <= eg - g <= 4 * pad and abs(eo - o) <= 12 * pad, (layout, r, d)
                opt_total += eo
            assert opt_total == pytest.approx(o * layout.dp), (layout, r)


def test_expert_optimizer_state_shards_over_dp_over_ep_times_cp():
    lay = Layout(dp=8, cp=2, ep=4, distributed_optimizer=True)
    assert (lay.shard_group, lay.expert_shard_group) == (16, 4)
    w, g, o = state_bytes(1_000_000, lay, "bf16", experts=4_000_000, frozen=10)
    assert (w, g, o) == (10_000_040, 20_000_000, 12_000_000 / 16 + 12 * 4_000_000 / 4)


def test_moe_activation_bytes_within_10_percent_of_measured():
    """benchmarks/memory.py's measurement of an MoE layer (8 experts, top 2, with and without a shared expert):
    the routed copies, the router's logits and the shared expert are counted within 10%."""
    import dataclasses
    import importlib.util

    from engine.parallel.topology import ParallelContext
    spec = importlib.util.spec_from_file_location("benchmarks_memory", os.path.join(ROOT, "benchmarks", "memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for shared in (None, 96):
        cfg = dataclasses.replace(bench.llama_config("none"), num_experts=8, moe_router_topk=2,
                                  moe_ffn_hidden_size=176, moe_shared_expert_intermediate_size=shared)
        measured, _, _ = bench.measure(cfg, ParallelContext.virtual(), torch.device("cpu"))
        planned = 2 * layer_activation_bytes(cfg, bench.SEQ, bench.MICRO, 1, False, "none", True, moe=True)
        assert abs(planned - measured) / measured <= 0.10, (shared, planned, measured)
        dense = 2 * layer_activation_bytes(cfg, bench.SEQ, bench.MICRO, 1, False, "none", True)
        assert planned > dense  # two routed copies of every token outweigh one MLP of the same width


# --- exact engine bytes per sharding strategy, the ZeRO formulas, zero-bubble peaks ------------------------

SMALL = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--swiglu", "--vocab-size", "300", "--seq-length", "32", "--mock-data", "--bf16"]


def _engine_rank0(cfg, layout, pp_rank, bucket_numel):
    """Optimizer.memory_bytes() of dp rank 0 (Adam's scalar step counts left out), weights plus the frozen
    fp32 expert bias (no optimizer holds it)."""
    from engine.optim import adamw, build_optimizer
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    ctx = ParallelContext.virtual(layout=layout, pp_rank=pp_rank, dp_rank=0)
    cfg.parallel.use_distributed_optimizer = layout.distributed_optimizer
    cfg.parallel.data_parallel_sharding_strategy = layout.sharding_strategy
    chunks = build_model_chunks(cfg, ctx, vocab_size=cfg.model.vocab_size, device="meta", dtype=torch.bfloat16)
    opt = build_optimizer(cfg, chunks, ctx, bucket_numel=bucket_numel)
    held = opt.memory_bytes()
    frozen = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters() if not p.requires_grad)
    steps = sum(t.numel() * t.element_size() for t in adamw.state_tensors(opt.adam) if t.dim() == 0)
    return held["params"] + frozen, held["grads"], held["optimizer"] - steps


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("bucket_numel", [40_000_000, 5000], ids=["default-buckets", "small-buckets"])
@pytest.mark.parametrize("extra", [[], ["--untie-embeddings-and-output-weights"], MOE_ARGV[13:]],
                         ids=["tied", "untied", "moe"])
def test_state_bytes_equal_engine_exactly_bucket_padding_included(bucket_numel, extra, strategy):
    """Weights, gradients and optimizer state of dp rank 0 (the most loaded: shards are padded at the end of each
    bucket) equal Optimizer.memory_bytes(), byte for byte, under every sharding strategy: buckets padded to 64 x dp
    x cp elements, the tied embedding alone, buckets cut at bucket_numel and at every chunk, or under ZeRO-3 at
    every gathered unit (whatever bucket_numel), ZeRO-2/3 keeping 1/n of the gradients and ZeRO-3 1/n of the
    weights; and memory_per_gpu reports the same."""
    from engine.planner.sharding import rank_state_bytes
    cfg = parse_config(SMALL + extra)
    moe = bool(extra) and extra[0] == "--num-experts"
    layouts = [Layout(1, 1, 1), Layout(2, 2, 2, 1, sequence_parallel=True), Layout(1, 2, 4, 2),
               Layout(2, 2, 4, 1, sequence_parallel=True), Layout(1, 2, 8, 1)]
    if moe:
        layouts = [Layout(1, 1, 4, ep=2), Layout(2, 2, 4, sequence_parallel=True, ep=4), Layout(1, 2, 2, ep=2)]
    for layout in (dataclasses_replace(lay, sharding_strategy=strategy) for lay in layouts):
        for r in range(layout.pp):
            planned = rank_state_bytes(cfg.model, layout, "bf16", r, bucket_numel)
            assert planned == _engine_rank0(cfg, layout, r, bucket_numel), (layout, r)
        mem = memory_per_gpu(cfg.model, layout, 32, 4, bucket_numel=bucket_numel)
        assert (mem.weights, mem.grads, mem.optimizer) == rank_state_bytes(cfg.model, layout, "bf16", mem.rank,
                                                                           bucket_numel)


def test_zero_formulas_by_hand_for_7b_at_dp_8():
    """Rajbhandari et al. 2020 in this engine's dtypes, P = 7e9 parameters, bf16, dp 8: every byte computed here."""
    P, B, U = 7_000_000_000, 40_000_000, 200_000_000
    by_hand = {"no_shard": (2 * P, 4 * P, (8 + 4) * P),                         # bf16 weights, fp32 grads, m v master
               "optim": (2 * P, 4 * P, 12 * P / 8),
               "optim_grads": (2 * P, 4 * P / 8 + 4 * B, 12 * P / 8),            # + one bucket of fp32 staging
               "optim_grads_params": (2 * P / 8 + 2 * U, 4 * P / 8 + 4 * B, 12 * P / 8)}  # + one gathered layer
    for strategy, expected in by_hand.items():
        got = state_bytes(P, Layout(dp=8, sharding_strategy=strategy), "bf16", unit=U, bucket=B)
        assert got == pytest.approx(expected, rel=1e-12), strategy
    assert state_bytes(P, Layout(dp=8, sharding_strategy="no_shard"), "fp32") == (4 * P, 4 * P, 8 * P)  # no master
    assert Layout(dp=8, sharding_strategy="optim_grads").distributed_optimizer
    assert not Layout(dp=8, distributed_optimizer=True, sharding_strategy="no_shard").distributed_optimizer


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_exact_bytes_of_llama3_8b_are_the_zero_formula_plus_shard_padding(strategy):
    """The exact per-rank bytes of Llama 3 8B at dp 8 are the formula's, give or take each bucket's padding (less
    than 64 x 8 elements a bucket), plus ZeRO-2/3's gradient staging and ZeRO-3's gathered unit (sharding.py's
    transient allowances) in the formula's `bucket` and `unit`."""
    from engine.planner.params import params_per_rank
    from engine.planner.sharding import rank_buckets, rank_state_bytes, rank_transient_bytes
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama3-8b.yaml")])
    lay = Layout(dp=8, sharding_strategy=strategy)
    buckets = rank_buckets(cfg.model, lay, 0)
    staging, gathered = rank_transient_bytes(cfg.model, lay, "bf16", 0)
    zero3 = strategy == "optim_grads_params"
    formula = state_bytes(params_per_rank(cfg.model, lay)[0], lay, "bf16", unit=gathered // 2 if zero3 else 0,
                          bucket=staging // 4)
    weights, grads, optimizer = rank_state_bytes(cfg.model, lay, "bf16", 0)
    exact = (weights + (gathered if zero3 else 0), grads + staging, optimizer)
    slack = 64 * 8 * len(buckets) * np.array([2, 4, 12])
    assert np.all(np.abs(np.array(exact) - np.array(formula)) <= slack), (exact, formula)


def test_zero_bubble_peaks_follow_the_schedules_order():
    """ZB-H1 keeps 1F1B's peak on rank 0 (pp chunks with F done, none waiting for W) and later ranks hold their
    1F1B activations plus W stores; every rank's peak is the largest A x activations + W x stores over its own order
    (recounted here), and it does not change past 3 pp microbatches."""
    from engine.pipeline.schedules import schedule_order
    from engine.planner.activations import in_flight_bytes, w_store_bytes, zb_in_flight
    m = gpt(8, 1024, 16, seq=1024)
    act, store = layer_activation_bytes(m, 1024, 1), w_store_bytes(m, 1024, 1)
    assert 0 < store < act
    for schedule, vpp in (("zb-h1", 1), ("zb-v", 2)):
        lay = Layout(1, 4, 1, vpp, pipeline_schedule=schedule)
        for r in range(4):
            a = w = 0
            peak = 0.0
            for kind, _, _ in schedule_order(lay.schedule, r, 12):
                a, w = a + (kind == "F") - (kind == "B"), w + (kind == "B") - (kind == "W")
                peak = max(peak, a * act + w * store)
            assert in_flight_bytes(lay, r, 12, act, store) == pytest.approx(peak)
            assert zb_in_flight(lay.schedule, r, 12) == zb_in_flight(lay.schedule, r, 20)
    h1 = Layout(1, 4, 1, pipeline_schedule="zb-h1")
    one = PipelineSchedule.of(None, 4)
    assert in_flight_bytes(h1, 0, 12, act, store) == peak_in_flight(one, 0, 12) * act
    assert in_flight_bytes(h1, 3, 12, act, store) > peak_in_flight(one, 3, 12) * act
    mem = {s: memory_per_gpu(m, Layout(1, 4, 1, 2 if s == "zb-v" else 1, pipeline_schedule=s), 1024, 12)
           for s in ("1f1b", "zb-h1", "zb-v")}
    assert mem["zb-h1"].allocated == pytest.approx(mem["1f1b"].allocated, rel=0.05)  # ZB-H1 keeps about 1F1B's peak
    assert mem["zb-v"].rank == 0 and mem["zb-v"].logits > 0  # the V puts embedding and loss on rank 0


def test_dropout_masks_are_counted_only_with_dropout():
    cfg = parse_config(SMALL)
    s, b, h = 32, 2, 64
    without = layer_activation_bytes(cfg.model, s, b)
    cfg.model.hidden_dropout = 0.1
    assert layer_activation_bytes(cfg.model, s, b) - without == 2 * s * b * h  # two 1-byte residual masks
    cfg.model.attention_dropout = 0.1
    assert layer_activation_bytes(cfg.model, s, b) - without == 2 * s * b * h + 3 * 4 * s * s * b  # + mask, output

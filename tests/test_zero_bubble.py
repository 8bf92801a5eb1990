"""Zero-bubble schedules (ZB-H1, ZB-V) with split backward, against 1F1B and the unpipelined run (CPU, gloo)."""
import functools
import glob
import json
import math
import os

import pytest
import torch
from test_pipeline import MICRO, SEQ, VOCAB, global_batch, replay_exchanges

from engine.config import Config, ConfigError, ModelConfig
from engine.flops import UNIT, Costs, split_backward_costs
from engine.layout import Layout, PipelineSchedule
from engine.model import TIED_EMBEDDING, GPTModel
from engine.optim import GradBuffer
from engine.parallel import weight_grad_store
from engine.parallel.layers import spec_of
from engine.parallel.topology import ParallelContext, build_context
from engine.pipeline import schedules, zero_bubble
from engine.pipeline.p2p import exchange_plan
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.replay import replay, steady_period
from engine.pipeline.runner import PipelineRunner
from engine.pipeline.trace import PipelineTrace
from engine.validation import validate
from harness import NO_DROPOUT, SGD_LR, full_grad, run_ranks, sgd_reference

ZB = ("zb-h1", "zb-v")
VPP = {"zb-h1": 1, "zb-v": 2}
S = PipelineSchedule.of


# ---------------------------------------------------------------- placement and schedule shape

def test_v_placement_runs_chunk_0_down_and_chunk_1_back_up():
    v = S("zb-v", 4)
    assert [v.stage_of(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(v.place(v.stage_of(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    layers = [[Layout(pp=4, pipeline_schedule="zb-v").layer_ids(16, r, c) for c in (0, 1)] for r in range(4)]
    assert layers[0] == [[0, 1], [14, 15]] and layers[3] == [[6, 7], [8, 9]]
    assert v.neighbours(3) == ((2, 0), (3, 1))  # the turn of the V stays on rank 3
    cfg = Config()
    cfg.model = model_cfg(tied=True)
    cfg.parallel.pipeline_model_parallel_size, cfg.parallel.pipeline_schedule = 4, "zb-v"
    layout = Layout.from_config(cfg, 4)
    first = build_model_chunks(cfg, ParallelContext.virtual(layout=layout, pp_rank=0), vocab_size=VOCAB, device="meta")
    assert layout.vpp == 2 and [(c.pre_process, c.post_process) for c in first] == [(True, False), (False, True)]
    assert first[0].layer_ids == [0] and first[1].layer_ids == [7]  # embedding and loss both on rank 0


def _ops(order, kind):
    return sorted((c, mb) for k, c, mb in order if k == kind)


@pytest.mark.parametrize("schedule", ZB)
def test_every_rank_runs_each_f_b_w_once_in_dependency_order(schedule):
    for pp in range(2, 9):
        for m in (1, pp - 1, pp, 2 * pp + 1, 3 * pp):
            for r in range(pp):
                order = schedules.schedule_order(S(schedule, pp), r, max(m, 1))
                every = sorted((c, mb) for c in range(VPP[schedule]) for mb in range(max(m, 1)))
                assert _ops(order, "F") == _ops(order, "B") == _ops(order, "W") == every
                pos = {op: i for i, op in enumerate(order)}
                assert all(pos[("F", c, mb)] < pos[("B", c, mb)] < pos[("W", c, mb)] for c, mb in every)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 3), (8, 16), (8, 32)])
def test_zb_h1_holds_no_more_activations_than_1f1b(pp, m):
    """Per rank, activations (forward done, B not) never exceed 1F1B's count there, and with the stores W
    still needs they never exceed 1F1B's peak (rank 0's pp microbatches)."""
    for r in range(pp):
        zb = schedules.schedule_order(S("zb-h1", pp), r, m)
        one_f_one_b = schedules.max_in_flight(schedules.schedule_order(S(None, pp), r, m))
        assert schedules.max_in_flight(zb) <= one_f_one_b == schedules.peak_in_flight(S(None, pp), r, m)
        assert schedules.max_in_flight(zb, until="W") <= schedules.peak_in_flight(S(None, pp), 0, m)
    for r in range(pp):  # ZB-V: activations of 2pp chunk-microbatches (half the rank's layers each), 1F1B's
        order = schedules.schedule_order(S("zb-v", pp), r, m)  # peak; with the stores W needs, at most 3pp
        assert schedules.max_in_flight(order) <= 2 * schedules.peak_in_flight(S(None, pp), 0, m)
        assert schedules.peak_in_flight(S("zb-v", pp), r, m) <= 3 * pp


def test_simulated_bubbles_with_equal_f_b_w():
    """p = 8, m = 32, F = B = W, the bubble taken from replaying the orders themselves, steps back to back as
    the engine runs them. ZB-H1: a third of 1F1B's bubble. ZB-V: zero, because its optimizer steps
    without waiting for the other stages (engine.optim.post_validation) and its orders form a
    parallelogram: every rank is busy from its first operation to its last, and a rank starting (p-1)F/2
    later also ends that much later. One step alone, every stage starting together, keeps that (p-1)F/2 as
    bubble (a sixth of 1F1B's), which is what a pipeline-wide barrier before the optimizer step costs. 1F1B
    gains nothing from running steps back to back (its first rank starts first and ends last)."""
    p, m = 8, 32
    base = schedules.simulate(S(None, p), m, 1.0, 1.0, 1.0)
    h1 = schedules.simulate(S("zb-h1", p), m, 1.0, 1.0, 1.0)
    v = schedules.simulate(S("zb-v", p), m, 1.0, 1.0, 1.0)
    assert base["bubble"] == pytest.approx((p - 1) / m) == pytest.approx(base["steady_bubble"])
    assert h1["steady_bubble"] <= 0.36 * base["steady_bubble"] and h1["period"] - h1["ideal"] == pytest.approx(p - 1)
    assert v["steady_bubble"] <= 0.1 * base["steady_bubble"] and v["period"] == pytest.approx(v["ideal"])
    assert v["makespan"] - v["ideal"] == pytest.approx((p - 1) / 2)  # one step alone, behind a barrier
    orders = [schedules.schedule_order(S("zb-v", p), r, m) for r in range(p)]
    times = replay(orders, S("zb-v", p), {"F": 0.5, "B": 0.5, "W": 0.5})
    for r, order in enumerate(orders):  # the parallelogram: rank r starts at r F/2, busy for its whole share
        start = min(times[(k, r, c, mb)][0] for k, c, mb in order)
        end = max(times[(k, r, c, mb)][1] for k, c, mb in order)
        assert start == r / 2 and end - start == pytest.approx(v["ideal"]), (r, start, end)
    # costs matter: free weight gradients leave ZB-H1 nothing to fill its bubble with
    assert schedules.simulate(S("zb-h1", p), m, 1.0, 1.0, 0.0)["bubble"] > h1["bubble"]


def test_the_steady_period_is_one_ranks_work_only_when_nothing_waits():
    """replay.steady_period on hand-made orders: two stages, one microbatch per step, F = B = 1 (no W).
    Stage 1 cannot start a step before stage 0's forward, and stage 0 cannot end one before stage 1's
    backward: back to back, a step takes F + F + B + B = 4, the makespan, not one stage's work of 2."""
    orders = [[("F", 0, 0), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    assert steady_period(orders, S(None, 2), {"F": 1, "B": 1}, 1) == 4
    assert steady_period(orders[:1], S(None, 1), {"F": 1, "B": 1}, 1) == 2  # alone, a stage waits for nothing


UNEQUAL = [Costs(1, 1.5, 0.5), Costs(1, 2, 1), Costs(1, 2.2, 0.8)]


@pytest.mark.parametrize("costs", UNEQUAL, ids=lambda c: "F{}-B{}-W{}".format(*c))
def test_orders_built_for_unequal_costs_beat_1f1b_and_the_equal_cost_orders(costs):
    """p = 8, m = 32. Replayed at unequal costs, orders built as if F = B = W leave ZB-V worse than 1F1B (the
    first two cases); the orders built for the costs keep both schedules ahead of 1F1B and never behind the
    equal-cost orders. (F, 2.2, 0.8): full recomputation, B holding a second forward."""
    p, m = 8, 32
    base = schedules.simulate(S(None, p), m, costs.forward, costs.input_grad + costs.weight_grad)["bubble"]
    for schedule in ZB:
        built = schedules.simulate(S(schedule, p), m, *costs)["bubble"]
        equal = schedules.simulate(S(schedule, p), m, *costs, built_for=UNIT)["bubble"]
        assert built <= equal and built < base, (schedule, built, equal, base)
    v_equal = schedules.simulate(S("zb-v", p), m, *costs, built_for=UNIT)["bubble"]
    assert v_equal > base or costs == UNEQUAL[2]
    if costs != UNEQUAL[2]:  # B-heavy orders stay far from ZB-V's best (0.84x 1F1B's at B 2.2: README)
        assert schedules.simulate(S("zb-v", p), m, *costs)["bubble"] < 0.35 * base
    for r in range(p):  # the memory caps hold whatever the costs
        order = schedules.schedule_order(S("zb-h1", p), r, m, costs)
        assert schedules.max_in_flight(order) <= p - r and schedules.max_in_flight(order, until="W") <= p
        order = schedules.schedule_order(S("zb-v", p), r, m, costs)
        assert schedules.max_in_flight(order) <= 2 * p and schedules.peak_in_flight(S("zb-v", p), r, m, costs) <= 3 * p


def test_costs_come_from_the_models_flops_split():
    """Input and weight gradients each cost their matrix multiply's forward; the attention core's backward
    (twice its forward) and recomputation go to B; the routed experts' weight gradients are not deferred."""
    from engine.flops import _layer_flops
    dense = model_cfg(tied=False)
    f = _layer_flops(dense, SEQ)
    plain, full = split_backward_costs(dense, SEQ), split_backward_costs(dense, SEQ, "full")
    assert plain.forward == f["linear"] + f["attention"] == full.forward
    assert plain.weight_grad == f["linear"] == full.weight_grad  # every dense weight is deferred
    assert plain.input_grad == f["linear"] + 2 * f["attention"] and full.input_grad == plain.input_grad + plain.forward
    assert split_backward_costs(dense, SEQ, "selective").input_grad == plain.input_grad + f["attention"]
    moe = ModelConfig(**{**dense.__dict__, "num_experts": 4, "moe_router_topk": 2})
    costs = split_backward_costs(moe, SEQ)
    assert costs.input_grad + costs.weight_grad == pytest.approx(2 * costs.forward) and \
        costs.weight_grad < _layer_flops(moe, SEQ)["linear"] / 2
    with pytest.raises(ValueError, match="positive forward"):
        zero_bubble.orders(S("zb-v", 4), 8, costs=Costs(0, 1, 1))


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("costs", [UNIT, UNEQUAL[0], UNEQUAL[2]], ids=["equal", "B1.5-W0.5", "B2.2-W0.8"])
def test_zero_bubble_exchange_plans_never_deadlock_and_pair_up(forward_only, costs):
    for schedule in ZB:
        vpp = VPP[schedule]
        for pp in range(2, 9):
            for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp + 1, 3 * pp} - {0}):
                plans = [exchange_plan(schedules.schedule_steps(S(schedule, pp), r, m, forward_only, costs),
                                       S(schedule, pp), r, costs) for r in range(pp)]
                result = replay_exchanges(plans)
                assert result["sent"] == result["expected"], (schedule, pp, m)
                assert sum(map(len, result["sent"].values())) == (2 - forward_only) * m * (pp * vpp - 1)


@pytest.mark.parametrize("flags,match", [
    (dict(pipeline_schedule="zb-h1", virtual_pipeline_model_parallel_size=2), "drop --vpp or use zb-v"),
    (dict(pipeline_schedule="zb-v", virtual_pipeline_model_parallel_size=4), "exactly 2 model chunks"),
    (dict(pipeline_schedule="interleaved"), "at least 2"),
    (dict(pipeline_schedule="1f1b", virtual_pipeline_model_parallel_size=2), "use interleaved"),
    (dict(pipeline_schedule="zb-h1", pipeline_model_parallel_size=1), "pipeline-model-parallel-size of at least 2"),
    (dict(pipeline_schedule="zb-v", pipeline_model_parallel_size=8), "divisible by 2 x pp = 16"),
])
def test_schedule_flags_are_validated(flags, match):
    cfg = Config()
    cfg.model = model_cfg(tied=True)
    cfg.parallel.pipeline_model_parallel_size, cfg.data.mock_data = 2, True
    for k, v in flags.items():
        setattr(cfg.parallel, k, v)
    with pytest.raises(ConfigError, match=f"^--pipeline-schedule .*{match}"):
        validate(cfg, cfg.parallel.pipeline_model_parallel_size)


def test_zb_v_is_valid_with_or_without_vpp_2_and_any_microbatch_count():
    for vpp in (None, 2):
        cfg = Config()
        cfg.model = model_cfg(tied=True)
        cfg.parallel.pipeline_model_parallel_size, cfg.parallel.pipeline_schedule = 4, "zb-v"
        cfg.parallel.virtual_pipeline_model_parallel_size = vpp
        cfg.training.global_batch_size, cfg.data.mock_data = 3, True  # 3: only interleaving needs a multiple of pp
        validate(cfg, 4)
        layout = Layout.from_config(cfg, 4)
        assert layout.vpp == 2 and layout.pipeline_schedule == "zb-v"


def test_split_backward_on_one_rank_gives_autograds_gradients():
    """B (input gradients) then W (weight gradients from the store) equals one whole backward, with full
    recomputation replaying the forward inside B; each weight's accumulate hook fires once, in W."""
    cfg = model_cfg(tied=False, recompute="full")
    mb = global_batch(0, MICRO)[0]
    whole = GPTModel(cfg, ParallelContext(), seed=9, vocab_size=VOCAB)
    whole(mb["tokens"], labels=mb["labels"]).mean().backward()
    split = GPTModel(cfg, ParallelContext(), seed=9, vocab_size=VOCAB)
    hooks = {}
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: hooks.__setitem__(n, hooks.get(n, 0) + 1))
    store = []
    with weight_grad_store.deferring_weight_grads(store):
        loss = split(mb["tokens"], labels=mb["labels"]).mean()
        loss.backward()
    linears = {n for n, p in split.named_parameters() if p.dim() >= 2 and "word" not in n}
    assert {n for n, p in split.named_parameters() if p.grad is None} == linears and len(store) == len(linears)
    weight_grad_store.weight_grads(store)
    assert not store and set(hooks.values()) == {1} and len(hooks) == len(list(split.parameters()))
    want = dict(whole.named_parameters())
    for n, p in split.named_parameters():
        torch.testing.assert_close(p.grad, want[n].grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- execution equals the unpipelined run

def model_cfg(tied: bool, recompute=None) -> ModelConfig:
    return ModelConfig(**NO_DROPOUT, num_layers=8, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
                       vocab_size=VOCAB, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                       position_embedding_type="rope", swiglu=True, disable_bias_linear=not tied,
                       untie_embeddings_and_output_weights=not tied, recompute_granularity=recompute)


@functools.lru_cache(maxsize=None)
def reference_run(tied: bool, samples: int, steps: int) -> tuple:
    """The same SGD training on one rank, in this process (once per batch shape): curve and step-0 grads."""
    model = GPTModel(model_cfg(tied), ParallelContext(), seed=9, vocab_size=VOCAB)
    return sgd_reference(model, lambda step: global_batch(step, samples), steps)


def _zb_layout(rank, world, tp, pp, schedule, tied, recompute, steps, microbatches, distributed, trace):
    cfg = Config()
    cfg.model = model_cfg(tied, recompute)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.pipeline_schedule, cfg.parallel.sequence_parallel, cfg.training.seed = schedule, tp > 1, 9
    ctx = build_context(world, rank, tp, pp, sequence_parallel=tp > 1, seed=9, schedule=schedule)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    tracer = PipelineTrace(rank, ctx.pp_rank) if trace else None
    cfg.training.micro_batch_size = MICRO
    runner = PipelineRunner.from_config(cfg, chunks, ctx, torch.float32, "cpu", tracer)  # the model's costs
    buffer = GradBuffer(chunks, ctx, distributed=distributed, overlap=True, bucket_numel=3000)
    curve, grads, launched_in_backward = [], {}, True
    for step in range(steps):
        mbs = global_batch(step, microbatches * MICRO * ctx.dp_size)
        buffer.start_step(microbatches)
        if tracer is not None:
            tracer.iteration = step
        curve.append(runner.run(mbs[ctx.dp_rank * microbatches:(ctx.dp_rank + 1) * microbatches]))
        launched_in_backward &= all(b.launched for b in buffer.buckets)  # each bucket went after its last W
        buffer.finish()
        if step == 0:
            grads = {(c, n): _grad_of(p, ctx, buffer, distributed) for c, chunk in enumerate(chunks)
                     for n, p in chunk.named_parameters()}
        with torch.no_grad():
            for p in buffer.params:
                p -= SGD_LR * p.main_grad  # plain SGD, as on the reference
    if tracer is not None:
        tracer.write(trace)
    ctx.destroy()
    return curve, grads, launched_in_backward


def _grad_of(p, ctx, buffer, distributed):
    """The whole gradient, or under the distributed optimizer (this rank's flat range, its TP rank, axis)."""
    if not distributed:
        return full_grad(p, ctx).clone()  # a view of the buffer, for replicated parameters
    return buffer.local_range(p), p.main_grad.reshape(-1).clone(), ctx.tp_rank, ctx.tp_size


def _compare(results, ref_curve, ref_grads, tied, steps) -> list:
    failures = []
    for rank, (curve, grads, launched) in enumerate(results):
        if not launched:
            failures.append(f"rank {rank}: a bucket was not complete when the schedule ended")
        if abs(curve[0] - ref_curve[0]) > 1e-5:
            failures.append(f"rank {rank}: loss {curve[0]} vs {ref_curve[0]}")
        diff = max(abs(a - b) for a, b in zip(curve, ref_curve[:steps]))
        if diff > 1e-4:
            failures.append(f"rank {rank}: {steps}-step curve differs by {diff}")
        for (chunk, name), got in grads.items():
            want = ref_grads[TIED_EMBEDDING if name == "output" and tied else name]
            if isinstance(got, tuple):
                (lo, hi), flat, tp_rank, tp_size = got if got[0] is not None else ((0, 0), *got[1:])
                axis = spec_of_name(name)
                want = (want if axis is None else want.chunk(tp_size, dim=axis)[tp_rank]).reshape(-1)[lo:hi]
                got = flat[lo:hi]
                if not want.numel():
                    continue  # another replica holds all of this one
            err = (got - want).abs().max().item()
            if err > 1e-5 * want.abs().max().item() + 1e-8:
                failures.append(f"rank {rank}: grad {name} (chunk {chunk}) err {err:.3g}")
    return failures


def spec_of_name(name: str):
    """The TP axis of a parameter, by name, from a meta-device model split over 2 ranks."""
    if not hasattr(spec_of_name, "axes"):
        models = [GPTModel(model_cfg(tied), ParallelContext.virtual(tp=2), device="meta", vocab_size=VOCAB)
                  for tied in (False, True)]
        spec_of_name.axes = {n: spec_of(p).tp_axis for model in models for n, p in model.named_parameters()}
        spec_of_name.axes[TIED_EMBEDDING] = spec_of_name.axes["output"] = 0
    return spec_of_name.axes[name]


LAYOUTS = [  # (tp, pp, schedule, tied, recompute, steps, microbatches per dp rank, distributed optimizer, traced)
    (2, 2, "zb-h1", True, None, 20, 3, False, False),          # dp 2, sequence parallel, tied across stages
    (2, 4, "zb-h1", False, None, 20, 4, False, False),         # dp 1
    (2, 2, "zb-v", True, None, 20, 3, False, False),           # dp 2, both tied copies on rank 0
    (1, 4, "zb-v", False, "full", 20, 4, False, True),         # dp 2, traced and drawn; its order is built for
                                                               # B = 2 F (recomputation), not F = B = W
    (1, 4, "zb-v", True, None, 1, 4, True, False),             # dp 2, distributed optimizer's gradient shards
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,schedule,tied,recompute,steps,microbatches,distributed,traced", LAYOUTS,
                         ids=[f"tp{t}-pp{p}-{s}-{'tied' if tie else 'untied'}-{r or 'norecompute'}"
                              f"{'-distopt' if d else ''}" for t, p, s, tie, r, _, _, d, _ in LAYOUTS])
def test_zero_bubble_loss_gradients_and_curves_equal_one_rank(tp, pp, schedule, tied, recompute, steps,
                                                              microbatches, distributed, traced, tmp_path):
    prefix = str(tmp_path / "trace") if traced else None
    costs = split_backward_costs(model_cfg(tied, recompute), SEQ, recompute)
    if recompute:  # the runner's order is the one built for the model's costs, and here that is another order
        assert zero_bubble.orders(S(schedule, pp), microbatches, costs=costs) != \
            zero_bubble.orders(S(schedule, pp), microbatches)
    results = run_ranks(_zb_layout, 8, tp, pp, schedule, tied, recompute, steps, microbatches, distributed, prefix,
                        timeout=300)
    dp = 8 // (tp * pp)
    ref_curve, ref_grads = reference_run(tied, microbatches * MICRO * dp, steps)
    problems = _compare(results, ref_curve, ref_grads, tied, steps)
    assert not problems, "\n".join(problems)
    if traced:
        _draw_trace(prefix, tmp_path / "zbv.png", steps, microbatches * 2 * pp * 3 * dp)


def _draw_trace(prefix: str, out, steps: int, operations: int) -> None:
    """tools/plot_pipeline.py draws the real run's trace (--pipeline-trace's files), B and W apart."""
    import plot_pipeline
    events = [json.loads(line) for f in glob.glob(prefix + ".rank*.jsonl") for line in open(f)]
    last = [e for e in events if e["iteration"] == steps - 1]
    assert {e["kind"] for e in last} == {"F", "B", "W"} and len(last) == operations
    assert plot_pipeline.main([prefix, "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000 and plot_pipeline.COLOURS["W"] != plot_pipeline.COLOURS["B"]


def test_the_planner_takes_the_schedules_bubble():
    from engine.flops import GPU_PRESETS
    from engine.planner.step_time import estimate
    cfg = ModelConfig(**NO_DROPOUT, num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000)
    gpu = GPU_PRESETS["h100-sxm"]
    one = estimate(cfg, Layout(tp=8, pp=8, dp=1), gpu, 32, 4096).breakdown["bubble"]
    h1 = estimate(cfg, Layout(tp=8, pp=8, dp=1, pipeline_schedule="zb-h1"), gpu, 32, 4096)
    v = estimate(cfg, Layout(tp=8, pp=8, dp=1, pipeline_schedule="zb-v"), gpu, 32, 4096)
    # B outweighs W here (the attention core's backward is all in B), so ZB-H1 keeps about (F + B - W)/(F + B + W)
    # of 1F1B's bubble, more than the third it keeps with F = B = W
    assert 0 < v.breakdown["bubble"] < h1.breakdown["bubble"] < 0.6 * one
    assert h1.step_time_s < estimate(cfg, Layout(tp=8, pp=8, dp=1), gpu, 32, 4096).step_time_s


@pytest.mark.slow
def test_the_launcher_trains_with_zb_h1_the_distributed_optimizer_and_overlap(tmp_path):
    from test_trainer import TINY, launch
    metrics = tmp_path / "metrics.jsonl"
    args = TINY + ["--pp", "2", "--pipeline-schedule", "zb-h1", "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--train-iters", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--metrics-file",
                   str(metrics)]
    code, output, _ = launch(args, 4, timeout=240)
    assert code == 0, output[-4000:]
    train = [r for r in map(json.loads, open(metrics)) if "event" not in r and "split" not in r]
    assert [r["iteration"] for r in train] == list(range(1, 9))
    assert all(math.isfinite(r["lm_loss"]) for r in train) and train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.05

"""Pipeline partitioning, schedules and execution against the unpipelined run (fp32, CPU, gloo)."""
import functools
import warnings

import pytest
import torch

from engine.config import Config, ConfigError, ModelConfig
from engine.layout import Layout, PipelineSchedule
from engine.model import TIED_EMBEDDING, GPTModel
from engine.parallel.topology import ParallelContext, build_context
from engine.pipeline import schedules
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner
from harness import NO_DROPOUT, SGD_LR, full_grad, grad_buffer, run_ranks, sgd_reference

VOCAB, SEQ, MICRO = 96, 8, 2


# ---------------------------------------------------------------- partitioning and schedule shape

def test_even_uneven_and_interleaved_partitions():
    assert [Layout(pp=4).layer_ids(8, r, 0) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    uneven = Layout(pp=4, first_stage_layers=1, last_stage_layers=3)
    assert uneven.stage_sizes(10) == [1, 3, 3, 3]
    assert uneven.layer_ids(10, 3, 0) == [7, 8, 9]
    # interleaved: chunk c on pipeline rank r holds virtual stage c*pp + r
    two = Layout(pp=2, vpp=2)
    assert two.layer_ids(8, 0, 0) == [0, 1] and two.layer_ids(8, 1, 0) == [2, 3]
    assert two.layer_ids(8, 0, 1) == [4, 5] and two.layer_ids(8, 1, 1) == [6, 7]
    for pp, vpp in ((2, 1), (4, 1), (2, 2), (4, 2)):
        ids = sorted(i for r in range(pp) for c in range(vpp) for i in Layout(pp=pp, vpp=vpp).layer_ids(16, r, c))
        assert ids == list(range(16))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 3), (8, 16)])
def test_1f1b_holds_at_most_pp_minus_rank_microbatches(pp, m):
    for r in range(pp):
        order = schedules.schedule_order(PipelineSchedule.of(None, pp), r, m)
        assert sorted(o for o in order if o[0] == "F") == [("F", 0, i) for i in range(m)]
        assert schedules.max_in_flight(order) == schedules.peak_in_flight(PipelineSchedule.of(None, pp), r, m) <= pp - r


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 12), (8, 2, 16)])
def test_interleaved_holds_at_most_warmup_plus_one(pp, vpp, m):
    for r in range(pp):
        order = schedules.schedule_order(PipelineSchedule.of(None, pp, vpp), r, m)
        bound = schedules.warmup_count(pp, vpp, r, m) + 1  # the documented bound
        assert schedules.max_in_flight(order) == schedules.peak_in_flight(PipelineSchedule.of(None, pp, vpp), r, m) <= bound
        assert len(order) == 2 * m * vpp


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (4, 1, 16), (8, 1, 32), (2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_replayed_bubble_is_textbook(pp, vpp, m):
    sim = schedules.simulate(PipelineSchedule.of(None, pp, vpp), m, t_forward=1.0, t_backward=2.0)
    assert sim["bubble"] == pytest.approx((pp - 1) / (vpp * m), abs=1e-9)


def replay_exchanges(plans: list) -> dict:
    """Run every rank's exchange plan under nccl's rules for batched p2p, without tensors.

    A rank posts its next batch only when the previous one has completed; a batch completes when each of
    its sends has its receive posted and each receive its send; the k-th send from a to b meets the k-th
    receive at b from a. A message to the rank itself (ZB-V's turn of the V) is kept in memory: its send
    completes at once and its receive needs the send posted. Returns, per (sender, receiver), the labels
    sent and the labels expected, and raises on deadlock.
    """
    pp = len(plans)
    idx = [0] * pp
    sent = {(a, b): [] for a in range(pp) for b in range(pp)}
    expected = {(a, b): [] for a in range(pp) for b in range(pp)}
    mine = [[] for _ in range(pp)]  # (direction, pair, position) of the ops in each rank's posted batch

    def post(r):
        ops = []
        if idx[r] < len(plans[r]):
            step = plans[r][idx[r]][0]
            for m in step.sends:
                sent[(r, m.peer)].append(m[1:])
                ops.append(("send", (r, m.peer), len(sent[(r, m.peer)]) - 1))
            for m in filter(None, step.recvs):
                expected[(m.peer, r)].append(m[1:])
                ops.append(("recv", (m.peer, r), len(expected[(m.peer, r)]) - 1))
        mine[r] = ops

    for r in range(pp):
        post(r)
    while any(i < len(p) for i, p in zip(idx, plans)):
        progressed = False
        for r in range(pp):
            if idx[r] == len(plans[r]):
                continue
            if all(k < len((expected if d == "send" else sent)[pair]) or (d == "send" and pair == (r, r))
                   for d, pair, k in mine[r]):
                idx[r] += 1
                post(r)
                progressed = True
        if not progressed:
            raise RuntimeError(f"deadlock: ranks at exchanges {idx}")
    return {"sent": sent, "expected": expected}


@pytest.mark.parametrize("forward_only", [False, True])
def test_batched_exchanges_never_deadlock_and_pair_up(forward_only):
    """Every schedule the engine accepts, replayed under nccl's batch rules: no deadlock, right partners."""
    from engine.pipeline.p2p import exchange_plan
    cases = [(pp, 1, m) for pp in range(2, 9) for m in range(1, 2 * pp + 2)]
    cases += [(pp, v, k * pp) for pp in range(2, 9) for v in range(2, 5) for k in (1, 2, 3)]
    for pp, vpp, m in cases:
        schedule = PipelineSchedule.of(None, pp, vpp)
        plans = [exchange_plan(schedules.schedule_steps(schedule, r, m, forward_only), schedule, r) for r in range(pp)]
        result = replay_exchanges(plans)
        assert result["sent"] == result["expected"], (pp, vpp, m)
        assert sum(map(len, result["sent"].values())) == (2 - forward_only) * m * (pp * vpp - 1), (pp, vpp, m)


def test_replay_catches_a_deadlocking_plan():
    """The replay above can fail: two ranks that each receive before sending to the other hang."""
    from engine.pipeline.p2p import Exchange, Message
    a = [(Exchange((), (Message(1, "act", 0, 0),)), []), (Exchange((Message(1, "act", 1, 0),), ()), [])]
    b = [(Exchange((), (Message(0, "act", 1, 0),)), []), (Exchange((Message(0, "act", 0, 0),), ()), [])]
    with pytest.raises(RuntimeError, match="deadlock"):
        replay_exchanges([a, b])
    # and one batch per operation (instead of one per steady-state forward/backward pair) hangs interleaving
    from engine.pipeline.p2p import exchange_plan
    two = PipelineSchedule.of(None, 2, 2)
    per_op = [exchange_plan([[op] for op in schedules.schedule_order(two, r, 4)], two, r) for r in range(2)]
    with pytest.raises(RuntimeError, match="deadlock"):
        replay_exchanges(per_op)


def _exchange_both_ways(rank, world):
    """pp 2: each rank sends to and receives from the other in one batch, as interleaving does."""
    from engine.pipeline.p2p import Exchange, Message, StageLink
    ctx = build_context(world, rank, 1, 2)
    link = StageLink(ctx, (3, 2), torch.float32, "cpu")
    other = 1 - rank
    w = torch.ones(3, 2, requires_grad=True)
    act = w * (rank + 1)  # an activation with an autograd graph
    grad = torch.full((3, 2), 10.0 + rank)
    step = Exchange((Message(other, "act", 1, 0), Message(other, "grad", 0, 0)),
                    (Message(other, "act", 0, 0), Message(other, "grad", 1, 0)))
    got = link.exchange(step, [act, grad])
    ctx.destroy()
    return {"act": got[0].tolist(), "grad": got[1].tolist(), "act_numel": act.numel(),
            "grad_numel": grad.numel(), "act_keeps_graph": act.grad_fn is not None}


def test_batched_exchange_delivers_in_order_and_releases_sent_activations():
    results = run_ranks(_exchange_both_ways, 2, timeout=60)
    for rank, r in enumerate(results):
        other = 1 - rank
        assert r["act"] == [[other + 1.0] * 2] * 3 and r["grad"] == [[10.0 + other] * 2] * 3
        assert r["act_numel"] == 1 and r["act_keeps_graph"], "a sent activation keeps its graph, not its values"
        assert r["grad_numel"] == 6, "gradients are not released"


def test_impossible_interleaving_rejected_and_few_microbatches_warned():
    with pytest.raises(ConfigError, match="multiple of pp"):
        schedules.check_schedule(PipelineSchedule.of(None, 4, 2), 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedules.check_schedule(PipelineSchedule.of(None, 4), 2)
    assert any("microbatches" in str(w.message) for w in caught)


# ---------------------------------------------------------------- execution equals the unpipelined run

def model_cfg(tied: bool) -> ModelConfig:
    return ModelConfig(**NO_DROPOUT, num_layers=8, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=SEQ,
                       vocab_size=VOCAB, make_vocab_size_divisible_by=16, normalization="RMSNorm",
                       position_embedding_type="rope", swiglu=True, disable_bias_linear=not tied,
                       untie_embeddings_and_output_weights=not tied)


def global_batch(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step % 3)  # three batches, revisited: the loss falls
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return [{"tokens": t[i:i + MICRO, :-1], "labels": t[i:i + MICRO, 1:]} for i in range(0, n, MICRO)]


def _layout(rank, world, tp, pp, vpp, tied, steps, microbatches):
    """This layout's loss curve and step-0 gradients (whole tensors, by chunk and name) on this rank."""
    cfg = Config()
    cfg.model = model_cfg(tied)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.virtual_pipeline_model_parallel_size = vpp
    cfg.parallel.sequence_parallel = tp > 1
    cfg.training.seed = 9
    ctx = build_context(world, rank, tp, pp, vpp=vpp, sequence_parallel=tp > 1, seed=9)
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, MICRO, cfg.model.hidden_size), torch.float32, "cpu")
    params = [p for c in chunks for p in c.parameters()]
    grads, curve, first_grads = grad_buffer(chunks, ctx, microbatches), [], {}
    for step in range(steps):
        mbs = global_batch(step, microbatches * MICRO * ctx.dp_size)
        grads.start_step(microbatches)
        curve.append(runner.run(mbs[ctx.dp_rank * microbatches:(ctx.dp_rank + 1) * microbatches]))
        grads.finish()
        if step == 0:
            first_grads = {(i, n): full_grad(p, ctx).clone() for i, c in enumerate(chunks)
                           for n, p in c.named_parameters()}
        with torch.no_grad():
            for p in params:
                p -= SGD_LR * p.main_grad  # plain SGD, as on the reference
    ctx.destroy()
    return curve, first_grads


@functools.lru_cache(maxsize=None)
def reference_run(tied: bool, samples: int, steps: int) -> tuple:
    """The same SGD training unpipelined on one rank, in this process (once per batch shape, shared by the
    layouts): mean loss per step and step-0 gradients."""
    model = GPTModel(model_cfg(tied), ParallelContext(), seed=9, vocab_size=VOCAB)
    return sgd_reference(model, lambda step: global_batch(step, samples), steps)


def _compare(results: list, ref_curve: list, ref_grads: dict, tied: bool, steps: int) -> list:
    """Step-0 loss and every gradient within 1e-5 on every rank; with several steps, the curve within 1e-4 and
    falling."""
    failures = []
    for rank, (curve, grads) in enumerate(results):
        if abs(curve[0] - ref_curve[0]) > 1e-5:
            failures.append(f"rank {rank}: loss {curve[0]} vs {ref_curve[0]}")
        for (chunk, n), got in grads.items():
            want = ref_grads[TIED_EMBEDDING if n == "output" and tied else n]
            err = (got - want).abs().max().item()
            if err > 1e-5 * want.abs().max().item() + 1e-8:
                failures.append(f"rank {rank}: grad {n} (chunk {chunk}) err {err:.3g}")
        if steps > 1:
            diff = max(abs(a - b) for a, b in zip(curve, ref_curve))
            if diff > 1e-4:
                failures.append(f"rank {rank}: {steps}-step curve differs by {diff}")
            if not curve[-1] < curve[0]:
                failures.append(f"rank {rank}: loss did not fall {curve}")
    return failures


LAYOUTS_8 = [  # (tp, pp, vpp, tied, steps, microbatches per dp rank)
    (2, 2, 1, True, 20, 4), (2, 4, 2, False, 20, 4), (2, 2, 2, True, 20, 4), (2, 4, 1, False, 20, 4),
    (1, 4, 2, True, 20, 4), (1, 2, 2, False, 20, 2),
    (2, 2, 1, False, 20, 1),  # fewer microbatches than stages: warned, still correct
]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,vpp,tied,steps,microbatches", LAYOUTS_8,
                         ids=[f"tp{t}-pp{p}-vpp{v}-{'tied' if tie else 'untied'}-{m}mb" for t, p, v, tie, _, m in LAYOUTS_8])
def test_pipelined_loss_gradients_and_curves_equal_unpipelined(tp, pp, vpp, tied, steps, microbatches):
    results = run_ranks(_layout, 8, tp, pp, vpp, tied, steps, microbatches, timeout=300)
    ref_curve, ref_grads = reference_run(tied, microbatches * MICRO * 8 // (tp * pp), steps)
    problems = _compare(results, ref_curve, ref_grads, tied, steps)
    assert not problems, "\n".join(problems)

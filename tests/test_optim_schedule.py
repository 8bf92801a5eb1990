"""LR schedules, batch-size ramp-up and the loss scaler, value by value against their formulas."""
import math

import pytest

from engine.config import OptimizerConfig, TrainingConfig
from engine.data import BatchSampler, BatchSizeSchedule
from engine.optim import LossScaler, lr_at


def _opt(**kw):
    base = dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_iters=110)
    base.update(kw)
    return OptimizerConfig(**base)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_lr_schedule_matches_formula_at_every_iteration(style):
    opt = _opt(lr_decay_style=style, lr_wsd_decay_iters=40)
    for it in range(0, 131):
        got = lr_at(it, opt, train_iters=500)
        if it <= 10:
            want = 1e-3 * it / 10
        elif style == "constant":
            want = 1e-3
        elif it > 110:
            want = 1e-4
        else:
            r = (it - 10) / 100
            if style == "linear":
                want = 1e-4 + (1 - r) * 9e-4
            elif style == "cosine":
                want = 1e-4 + 0.5 * (1 + math.cos(math.pi * r)) * 9e-4
            else:
                want = 1e-3 if it <= 70 else 1e-4 + (2 * 0.5 ** ((it - 70) / 40) - 1) * 9e-4
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (style, it)


def test_lr_schedule_landmarks():
    opt = _opt(lr_decay_style="cosine")
    assert lr_at(0, opt, 500) == 0.0
    assert lr_at(10, opt, 500) == pytest.approx(1e-3)
    assert lr_at(60, opt, 500) == pytest.approx(5.5e-4)  # half-way down the cosine
    assert lr_at(110, opt, 500) == pytest.approx(1e-4)
    assert lr_at(111, opt, 500) == 1e-4
    wsd = _opt(lr_decay_style="wsd", lr_wsd_decay_iters=40)
    assert lr_at(110, wsd, 500) == pytest.approx(1e-4)  # the anneal ends exactly at min-lr
    # Without --lr-decay-iters the decay spans --train-iters.
    assert lr_at(50, _opt(lr_decay_style="linear", lr_decay_iters=None, lr_warmup_iters=0), 100) == pytest.approx(5.5e-4)


def _megatron_rampup(consumed, start, incr, samples, target):
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update, re-derived from its description."""
    increments = (target - start) // incr
    if consumed > samples:
        return target
    return start + int(consumed / (samples / increments)) * incr


def test_rampup_global_batch_value_by_value():
    ramp = BatchSizeSchedule(start=8, increment=8, samples=1000, final=64)
    per_increment = 1000 / 7
    for consumed in range(0, 1300, 3):
        got = ramp.at(consumed)
        assert got == _megatron_rampup(consumed, 8, 8, 1000, 64)
        if consumed <= 1000:
            assert got == 8 + 8 * math.floor(consumed / per_increment)
        else:
            assert got == 64
    assert BatchSizeSchedule.fixed(64).at(5000) == 64 and not BatchSizeSchedule.fixed(64).ramping


def test_rampup_iterations_keep_sampler_microbatches_and_lr_consistent():
    tr = TrainingConfig(micro_batch_size=2, global_batch_size=32, rampup_batch_size=[8, 8, 200])
    dp = 2
    ramp = BatchSizeSchedule.from_config(tr)
    assert ramp == BatchSizeSchedule(8, 8, 200, 32) and ramp.ramping
    samplers = [BatchSampler(ramp, 2, r, dp) for r in range(dp)]
    opt = _opt(lr_decay_style="linear", lr_warmup_iters=5, lr_decay_iters=40)
    consumed, batches = 0, []
    for it in range(30):
        gbs = ramp.at(consumed)
        assert ramp.samples_before(it) == consumed
        micro = [next(s) for s in samplers]
        assert sorted(i for rank in micro for mb in rank for i in mb) == list(range(consumed, consumed + gbs))
        assert all(len(rank) * 2 * dp == gbs for rank in micro)  # accumulation steps cover the global batch
        # Megatron counts the schedule in samples: warm-up 5 * 32 samples, decay to 40 * 32 samples.
        lr = lr_at(ramp.lr_position(consumed, it), opt, 30)
        if consumed <= 5 * 32:
            want = 1e-3 * consumed / (5 * 32)
        else:
            want = 1e-4 + (1 - (consumed - 160) / (40 * 32 - 160)) * 9e-4
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15)
        batches.append(gbs)
        consumed += gbs
    assert batches[:5] == [8, 8, 8, 8, 8]  # 200 / 3 increments = 66.7 samples per step of the ramp
    assert batches[-1] == 32 and sorted(batches) == batches
    assert consumed == sum(batches) == samplers[0].consumed_samples
    fixed = BatchSizeSchedule.from_config(TrainingConfig(global_batch_size=16))
    assert not fixed.ramping and fixed.lr_position(160, 10) == 10


def test_dynamic_loss_scaler_follows_megatron_rules():
    s = LossScaler(2.0 ** 16, dynamic=True, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0 ** 16  # first overflow spends hysteresis only
    s.update(True)
    assert s.scale == 2.0 ** 15
    s.update(True)
    assert s.scale == 2.0 ** 14  # hysteresis stays spent until the scale grows again
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0 ** 14
    s.update(False)
    assert s.scale == 2.0 ** 15  # grows after growth_interval clean steps
    s.update(True)
    assert s.scale == 2.0 ** 15  # hysteresis refilled by the growth
    saved = s.state_dict()
    t = LossScaler(1.0, dynamic=True, growth_interval=3, hysteresis=2)
    t.load_state_dict(saved)
    s.update(True)
    t.update(True)
    assert s.scale == t.scale == 2.0 ** 14
    low = LossScaler(2.0, dynamic=True, hysteresis=1)
    for _ in range(4):
        low.update(True)
    assert low.scale == 1.0  # never below min_scale


def test_loss_scaler_from_config():
    assert LossScaler.from_config(TrainingConfig()).scale == 1.0
    dyn = LossScaler.from_config(TrainingConfig(fp16=True))
    assert dyn.dynamic and dyn.scale == 2.0 ** 16
    static = LossScaler.from_config(TrainingConfig(fp16=True, loss_scale=128.0))
    static.update(True)
    static.load_state_dict({"scale": 4.0})
    assert not static.dynamic and static.scale == 128.0

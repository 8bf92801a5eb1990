"""LR schedules, batch-size ramp-up and the loss scaler, value by value against their formulas."""
import math

import pytest

from engine.config import Config, OptimizerConfig, TrainingConfig
from engine.data import BatchSampler, BatchSizeSchedule
from engine.optim import LossScaler, lr_at
from engine.optim.schedule import lr_at_sample
from engine.resolve import resolve


def _opt(**kw):
    base = dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_iters=110, lr_decay_style="cosine")
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


def megatron_lr(step, *, lr, min_lr, warmup, decay, style, init=0.0, wsd=None, wsd_style="exponential"):
    """Megatron-LM's OptimizerParamScheduler.get_lr at `step` (samples), from its documented behaviour: linear
    warm-up from init, then the decay style; WSD holds lr until its last `wsd` steps, then anneals by wsd_style."""
    if warmup > 0 and step <= warmup:
        return init + (lr - init) * float(step) / float(warmup)
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * max(warmup, 1) ** 0.5 / (max(step, 1) ** 0.5))
    ratio = (step - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif step <= decay - wsd:  # WSD: the stable phase
        coeff = 1.0
    else:
        q = (step - (decay - wsd)) / wsd
        coeff = {"exponential": 2.0 * 0.5 ** q - 1.0, "linear": 1.0 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1.0),
                 "minus_sqrt": 1.0 - math.sqrt(q)}[wsd_style]
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_decay_shapes_equal_megatron_formulas_bitwise(wsd_style):
    opt = _opt(lr_decay_style="WSD", lr_wsd_decay_iters=40, lr_wsd_decay_style=wsd_style)
    tr = TrainingConfig(global_batch_size=12, train_iters=500)
    landmarks = {70: 1e-3, 90: None, 110: 1e-4}  # stable to the anneal's start, min-lr at its end
    for it in range(0, 131):
        want = megatron_lr(it * 12, lr=1e-3, min_lr=1e-4, warmup=120, decay=1320, style="WSD", wsd=480,
                           wsd_style=wsd_style)
        assert lr_at_sample(it * 12, opt, tr) == want, (wsd_style, it)
        assert lr_at(it, opt, 500) == pytest.approx(want, rel=1e-12, abs=1e-15)  # the same curve in iterations
        if landmarks.get(it) is not None:
            assert want == pytest.approx(landmarks[it])
    mid = lr_at(90, opt, 500)  # half-way through the anneal: each shape's own value
    assert mid == pytest.approx(1e-4 + 9e-4 * {"exponential": 2 * 0.5 ** 0.5 - 1, "linear": 0.5, "cosine": 0.5,
                                               "minus_sqrt": 1 - 0.5 ** 0.5}[wsd_style])


def test_inverse_square_root_and_warmup_init_equal_megatron():
    opt = _opt(lr_decay_style="inverse-square-root", lr_warmup_init=2e-4)
    tr = TrainingConfig(global_batch_size=24, train_iters=100)
    for it in range(0, 120):
        got = lr_at_sample(it * 24, opt, tr)
        assert got == megatron_lr(it * 24, lr=1e-3, min_lr=1e-4, warmup=240, decay=2640, style="inverse-square-root",
                                  init=2e-4)
    assert lr_at_sample(0, opt, tr) == 2e-4 and lr_at_sample(240, opt, tr) == 1e-3
    assert lr_at_sample(4 * 240, opt, tr) == pytest.approx(5e-4)  # lr * sqrt(warmup / step)


def test_sample_based_schedule_counts_samples_as_megatron_does():
    """--train-samples: lengths in samples (decay default train-samples), warm-up as samples, a fraction of the
    decay, and from --lr-warmup-init; iteration runs convert by the global batch size."""
    tr = TrainingConfig(global_batch_size=24, train_samples=1000)
    cases = [
        (dict(lr_warmup_samples=77, lr_decay_samples=650), dict(warmup=77, decay=650)),
        (dict(lr_warmup_samples=77), dict(warmup=77, decay=1000)),
        (dict(lr_warmup_fraction=0.013, lr_decay_samples=650), dict(warmup=0.013 * 650, decay=650)),
        (dict(lr_warmup_samples=50, lr_warmup_init=3e-4, lr_decay_style="linear"), dict(warmup=50, decay=1000)),
    ]
    for kw, lengths in cases:
        opt = _opt(lr_warmup_iters=0, lr_decay_iters=None, **kw)
        for samples in range(0, 1100, 7):
            want = megatron_lr(samples, lr=1e-3, min_lr=1e-4, style=opt.lr_decay_style, init=opt.lr_warmup_init,
                               **lengths)
            assert lr_at_sample(samples, opt, tr) == want, (kw, samples)
    # Iteration-based with a warm-up fraction: fraction x (decay iterations x batch) samples.
    it_tr, opt = TrainingConfig(global_batch_size=24, train_iters=30), _opt(lr_warmup_iters=0, lr_warmup_fraction=0.05)
    for it in range(40):
        assert lr_at_sample(it * 24, opt, it_tr) == megatron_lr(it * 24, lr=1e-3, min_lr=1e-4, warmup=0.05 * 110 * 24,
                                                                decay=110 * 24, style="cosine")
    # A batch that is no power of two: positions in samples are Megatron's values; lr_at in iterations is within
    # rounding of them (the reason the trainer counts samples).
    opt = _opt(lr_decay_style="linear")
    values = [(lr_at_sample(it * 24, opt, it_tr), lr_at(it, opt, 30)) for it in range(120)]
    assert all(s == pytest.approx(i, rel=1e-12, abs=1e-15) for s, i in values)


def _megatron_train_iters(train_samples, rampup, global_batch):
    """Megatron-LM's update_train_iters, re-derived from its description: whole global batches; with ramp-up,
    step the ramp while the consumed samples are within both the ramp and train-samples, then whole batches."""
    if rampup is None:
        return train_samples // global_batch
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += _megatron_rampup(consumed, *rampup, global_batch)
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch if train_samples > consumed else iterations


@pytest.mark.parametrize("rampup", [None, [8, 8, 200], [16, 16, 1000], [4, 12, 90]])
def test_train_samples_gives_megatrons_iterations(rampup):
    for train_samples in (16, 17, 100, 199, 200, 201, 333, 1000, 1024, 5000):
        cfg = Config(training=TrainingConfig(micro_batch_size=4, global_batch_size=64 if rampup != [4, 12, 90] else 40,
                                             rampup_batch_size=rampup, train_samples=train_samples))
        cfg.data.mock_data = True
        tr = resolve(cfg, 1).training
        assert tr.train_iters == _megatron_train_iters(train_samples, rampup, tr.global_batch_size), train_samples
        assert resolve(cfg, 1).training.train_iters == tr.train_iters  # idempotent
    if rampup == [8, 8, 200]:  # 200 / 7 samples per increment: 8 8 8 8 16 16 24 32 40 48 = 208 samples, past 201
        assert _megatron_train_iters(201, rampup, 64) == 10 and _megatron_train_iters(5000, rampup, 64) == 10 + 74


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
    assert dyn.dynamic and dyn.scale == 2.0 ** 32 and dyn.hysteresis == 2  # Megatron-LM's defaults
    static = LossScaler.from_config(TrainingConfig(fp16=True, loss_scale=128.0))
    static.update(True)
    static.load_state_dict({"scale": 4.0})
    assert not static.dynamic and static.scale == 128.0

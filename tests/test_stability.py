"""SpikeGuard decisions on synthetic loss sequences, and the fault-drill helpers."""
import math

import pytest
import torch

from engine.config import ConfigError, StabilityConfig
from engine.stability import MIN_HISTORY, ROLLBACK, SKIP, SPIKE, FaultDrill, SpikeGuard, corrupt_batch, poison_loss
from engine.validation import parse_faults


def noisy_losses(n, base=3.0, amplitude=0.02):
    """A slowly falling loss with a small deterministic wiggle."""
    return [base - 0.001 * i + amplitude * math.sin(1.7 * i) for i in range(n)]


def run(guard, losses, start=1):
    return [guard.check(start + i, loss, 1.0).kind for i, loss in enumerate(losses)]


def test_nan_or_inf_skips_exactly_that_step():
    guard = SpikeGuard(window=20, threshold_k=4.0)
    losses = noisy_losses(30)
    losses[15] = float("nan")
    kinds = run(guard, losses)
    assert kinds.count(SKIP) == 1 and kinds[15] == SKIP
    assert set(kinds) == {"ok", SKIP}
    d = guard.check(31, 2.9, float("inf"))
    assert d.kind == SKIP and d.info["grad_norm"] == "inf" and d.info["reason"] == "non-finite gradient norm"
    assert guard.skipped == 2
    assert len(guard.losses) == 20  # the two skipped steps never entered the window


def test_spike_detected_only_after_min_history_and_kept_out_of_window():
    guard = SpikeGuard(window=50, threshold_k=6.0)
    early = run(guard, [3.0] * (MIN_HISTORY - 1) + [9.0])
    assert SPIKE not in early  # too little history to judge: accepted
    guard = SpikeGuard(window=50, threshold_k=6.0)
    run(guard, noisy_losses(20))
    window_before = list(guard.losses)
    limit = guard.threshold()
    d = guard.check(21, limit + 0.5, 1.0)
    assert d.kind == SPIKE and d.info["threshold"] == pytest.approx(limit)
    assert list(guard.losses) == window_before
    assert guard.check(22, limit - 0.01, 1.0).kind == "ok"  # just under the band is fine
    assert guard.spikes == 1


def test_rollback_after_n_spikes_within_window_only():
    guard = SpikeGuard(window=20, threshold_k=4.0, rollback_after=3)
    run(guard, noisy_losses(20))
    assert [guard.check(it, 10.0, 1.0).kind for it in (21, 22)] == [SPIKE, SPIKE]
    d = guard.check(23, 10.0, 1.0)
    assert d.kind == ROLLBACK and guard.rollbacks == 1 and d.info["spikes_in_window"] == 3
    assert guard.check(24, 10.0, 1.0).kind == SPIKE  # the count starts over after a rollback

    spaced = SpikeGuard(window=20, threshold_k=4.0, rollback_after=2)
    run(spaced, noisy_losses(20))
    assert spaced.check(21, 10.0, 1.0).kind == SPIKE
    run(spaced, noisy_losses(25)[20:], start=22)
    assert spaced.check(47, 10.0, 1.0).kind == SPIKE  # the first spike left the window 26 steps ago

    never = SpikeGuard(window=20, threshold_k=4.0, rollback_after=0)
    run(never, noisy_losses(20))
    assert set(run(never, [10.0] * 10, start=21)) == {SPIKE}


def test_lr_multiplier_window_after_rollback():
    guard = SpikeGuard(window=20, threshold_k=4.0, rollback_after=1, lr_factor=0.25, lr_steps=5)
    run(guard, noisy_losses(20))
    assert guard.lr_multiplier(21) == 1.0
    assert guard.check(21, 10.0, 1.0).kind == ROLLBACK
    assert [guard.lr_multiplier(i) for i in (21, 22, 26, 27)] == [1.0, 0.25, 0.25, 1.0]
    guard.rolled_back(10)  # the trainer reloaded iteration 10: the replay runs with the lower LR
    assert [guard.lr_multiplier(i) for i in (10, 11, 15, 16)] == [1.0, 0.25, 0.25, 1.0]


def test_state_dict_roundtrip_continues_identically():
    cfg = StabilityConfig(spike_window=15, spike_threshold=3.0, spike_rollback_after=2)
    a = SpikeGuard.from_config(cfg)
    run(a, noisy_losses(18) + [8.0])
    b = SpikeGuard.from_config(cfg)
    b.load_state_dict(a.state_dict())
    tail = noisy_losses(25)[19:] + [9.0, float("nan")]
    assert run(a, tail, start=20) == run(b, tail, start=20)
    assert a.state_dict() == b.state_dict()
    assert a.spikes == 2 and a.rollbacks == 1 and a.skipped == 1


def test_parse_faults_and_drill_helpers():
    assert parse_faults(["nan@20", "spike@40"]) == {20: "nan", 40: "spike"}
    assert parse_faults([]) == {}
    for bad in (["boom@3"], ["nan@x"], ["nan"], ["nan@3", "spike@3"]):
        with pytest.raises(ConfigError, match="--inject-fault"):
            parse_faults(bad)
    assert torch.isnan(poison_loss(torch.tensor(2.0, requires_grad=True)))
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long),
             "loss_mask": torch.ones(2, 8)}
    noisy, again = corrupt_batch(batch, 50), corrupt_batch(batch, 50)
    assert torch.equal(noisy["tokens"], again["tokens"]) and torch.equal(noisy["labels"], again["labels"])
    assert noisy["tokens"].dtype == torch.long and int(noisy["tokens"].max()) < 50
    assert len(noisy["labels"].unique()) > 5 and noisy["loss_mask"] is batch["loss_mask"]
    assert int(batch["tokens"].abs().sum()) == 0  # the original batch is untouched


def test_fault_drill_fires_once_at_its_iteration_and_the_guard_reports_it():
    drill = FaultDrill({2: "nan", 3: "spike"}, vocab_size=50)
    batch = {"tokens": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}
    double = lambda loss: loss * 2  # noqa: E731 - a stand-in for fp16 loss scaling
    mbs, scale = drill.arm(1, [batch], double)
    assert mbs == [batch] and scale is double and drill.reported_loss(1.5) == 1.5
    mbs, scale = drill.arm(2, [batch], double)
    assert mbs == [batch] and torch.isnan(scale(torch.tensor(1.0))) and math.isnan(drill.reported_loss(1.5))
    mbs, scale = drill.arm(3, [batch], double)
    assert int(mbs[0]["tokens"].abs().sum()) > 0 and scale is double and drill.reported_loss(1.5) == 1.5
    assert drill.arm(2, [batch], double) == ([batch], double), "a drill fires once (a rolled-back replay runs clean)"
    guard = SpikeGuard(window=4)
    (kind, info, line), = guard.events(guard.check(2, float("nan"), float("nan")), 2)
    assert kind == "skip" and info["reason"] == "non-finite loss" and info["skipped"] == 1 == guard.skipped
    assert line == "iteration 2: step skipped (non-finite loss); 1 skipped so far"

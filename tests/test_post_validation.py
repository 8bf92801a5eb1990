"""Optimizer post-validation under the zero-bubble schedules (engine.optim.post_validation), end to end.

Two torchrun jobs of 4 ranks (pp 2, dp 2) train the same tiny model with the same data: zb-v, whose
optimizer steps without waiting for the other stage and is checked one step later, and 1F1B, which waits
for the global norm before every step (the synchronous path, itself checked against one rank elsewhere).
Clipping is set so that it does not hit the first steps and hits the later ones, and a NaN drill makes one
step skip, so every way a step settles happens: kept, redone with the true clip coefficient, skipped.
"""

import pytest

from test_trainer import TINY, launch, read_records

CLIP = 0.45  # the tiny model's norms: about 0.42 over the first steps, 0.45-0.55 later
ARGS = TINY + ["--num-layers", "4", "--pp", "2", "--train-iters", "10", "--clip-grad", str(CLIP),
               "--inject-fault", "nan@3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("post_validation")
    found = {}
    for schedule in ("zb-v", "1f1b"):
        metrics = out / f"{schedule}.jsonl"
        code, output, _ = launch(ARGS + ["--pipeline-schedule", schedule, "--metrics-file", str(metrics)], 4,
                                 timeout=240)
        assert code == 0, output[-8000:]
        found[schedule] = read_records(str(metrics)), output
    return found


def _train(records):
    return {r["iteration"]: r for r in records if "event" not in r and "split" not in r}


@pytest.mark.slow  # two torchrun starts of 4 ranks (~40 s)
def test_post_validated_steps_equal_the_synchronous_ones_whether_kept_redone_or_skipped(runs):
    (checked, output), synchronous = runs["zb-v"], _train(runs["1f1b"][0])
    checked = _train(checked)
    assert sorted(checked) == sorted(synchronous) == list(range(1, 11))
    norms = [r["grad_norm"] for i, r in synchronous.items() if i != 3]
    assert min(norms) < CLIP < max(norms), norms  # some steps kept as they were taken, some redone clipped
    assert synchronous[3]["lm_loss"] is None and checked[3]["lm_loss"] is None  # the drill's skipped step
    for i in synchronous:
        a, b = checked[i], synchronous[i]
        assert a["skipped"] == b["skipped"] and a["lr"] == b["lr"], (i, a, b)
        if i != 3:
            assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-6, abs=1e-6), i
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), i
    assert checked[10]["skipped"] == 1
    # zb-v stepped before the check: a clipped or skipped step after a clean one (but the last, settled after
    # the loop) was redone and the step after it run again; after a redo steps wait for their check until
    # one passes, so a run of clipped steps costs one redo; 1F1B never speculates
    bad = {i: i == 3 or synchronous[i]["grad_norm"] > CLIP for i in synchronous}
    redone = [i for i in range(1, 10) if bad[i] and not bad.get(i - 1, False)]
    assert len(redone) < sum(bad[i] for i in range(1, 10)), bad  # some clipped steps were taken checked
    lines = [line for line in output.splitlines() if "optimizer step redone after its check" in line]
    assert [int(line.split("iteration ")[1].split(":")[0]) for line in lines] == redone, lines
    assert "non-finite loss" in lines[redone.index(3)] and "over --clip-grad" in lines[-1]
    assert "optimizer step redone" not in runs["1f1b"][1]


# ---------------------------------------------------------------- fp16: a loss-scale change, on one process

def _fp16_run(post_validated: bool, steps: int = 6) -> tuple:
    """Six fp16 steps of a tiny model whose dynamic loss scale doubles after every 2 clean steps; post-validated
    as engine.stepping orders it (step n's forward and backward, then step n-1 settled, then step n run again
    if that says so, then step n speculated) or synchronous. (the optimizer's state, loss scales, reruns)"""
    import torch

    from engine.config import Config, ModelConfig
    from engine.optim import build_optimizer
    from engine.optim.post_validation import PostValidator
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                            make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.training.fp16, cfg.training.initial_loss_scale, cfg.optim.clip_grad = True, 256.0, 100.0
    ctx = ParallelContext()
    model = build_model_chunks(cfg, ctx, vocab_size=64, dtype=torch.float16)[0]
    opt = build_optimizer(cfg, [model], ctx)
    opt.scaler.growth_interval = 2
    validator = PostValidator(opt, ctx)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 17), generator=g) for _ in range(steps)]

    def forward_backward(t) -> float:
        opt.start_step(1)
        loss = model(t[:, :-1], labels=t[:, 1:]).float().mean()
        opt.scale_loss(loss).backward()
        opt.finish_grad_sync()
        return loss.item()

    scales, reruns = [], 0
    for n, t in enumerate(batches):
        loss = forward_backward(t)
        if not post_validated:
            scales.append(opt.step(1e-3).loss_scale)
            continue
        settled = validator.settle()
        if settled is not None:
            scales.append(settled.result.loss_scale)
            if settled.rerun:
                reruns += 1
                loss = forward_backward(t)
        validator.speculate(1e-3, [loss])
    if post_validated:
        scales.append(validator.settle().result.loss_scale)
    state = torch.cat([t.detach().reshape(-1).float() for t in opt.rollback_tensors()])  # masters, grads, moments
    return state, scales, reruns


def test_fp16_post_validation_reruns_the_step_after_a_loss_scale_change_and_equals_the_synchronous_path():
    import torch
    want, want_scales, _ = _fp16_run(post_validated=False)
    got, scales, reruns = _fp16_run(post_validated=True)
    assert want_scales == scales == [256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]
    assert reruns == 2  # after each growth the step in flight, scaled with the old scale, runs again
    assert torch.equal(got, want)

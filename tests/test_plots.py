"""tools/plot_metrics.py and tools/plot_pipeline.py on synthetic metrics and schedules."""
import json
import math
import os

import plot_metrics
import plot_pipeline
import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_bytes=20_000):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes, (path, len(data))


def write_metrics(path, offset=0.0, resumed_from=None):
    """100 iterations with validation every 25, a skipped step, a spike and a rollback; optionally a
    resume from `resumed_from` appended, whose records must replace the first attempt's."""
    def train(it, loss):
        return {"iteration": it, "consumed_samples": 4 * it, "lm_loss": loss, "lr": 1e-3 * min(1, it / 10),
                "grad_norm": 1 / math.sqrt(it), "loss_scale": 1.0, "skipped": int(it >= 40),
                "tokens_per_sec": 5e4 + 100 * (it % 7), "tflops_per_gpu": 1.5, "mfu": None}
    lines = []
    for it in range(1, 101):
        lines.append(train(it, 6 * math.exp(-it / 30) + 2 + offset if it != 40 else None))
        if it % 25 == 0:
            lines.append({"iteration": it, "split": "valid", "lm_loss": 6 * math.exp(-it / 30) + 2.2 + offset})
    lines += [{"iteration": 40, "event": "skip"}, {"iteration": 70, "event": "spike", "loss": 9.0},
              {"iteration": 71, "event": "rollback"}]
    if resumed_from:
        lines += [train(it, 1.0) for it in range(resumed_from + 1, 101)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
        f.write('{"iteration": 101, "lm_lo')  # a line cut short by a crash


def simulate(p, m, chunks=1, t_f=1.0, t_b=2.0, t0=1.7e9):
    """Trace events of a pipeline run with equal-length passes and free communication.

    chunks == 1: 1F1B order. chunks > 1: all forwards chunk by chunk, then all backwards in reverse
    (a simple valid order; enough to exercise chunk shading). Dependencies: a forward needs the previous
    virtual stage's forward of that microbatch, a backward the next stage's backward.
    """
    stages = p * chunks
    orders = []
    for s in range(p):
        if chunks == 1:
            warm = min(p - s - 1, m)
            order = [("F", i, 0) for i in range(warm)]
            for i in range(m - warm):
                order += [("F", warm + i, 0), ("B", i, 0)]
            order += [("B", i, 0) for i in range(m - warm, m)]
        else:
            order = [("F", i, c) for c in range(chunks) for i in range(m)]
            order += [("B", i, c) for c in reversed(range(chunks)) for i in range(m)]
        orders.append(order)
    done, free, pos, events = {}, [0.0] * p, [0] * p, []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, mb, c = orders[s][pos[s]]
            vs = c * p + s
            dep = (("F", mb, vs - 1) if vs > 0 else None) if kind == "F" else \
                (("B", mb, vs + 1) if vs < stages - 1 else ("F", mb, vs))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0))
            end = start + (t_f if kind == "F" else t_b)
            done[(kind, mb, vs)] = free[s] = end
            pos[s] += 1
            events.append({"rank": s, "pp_rank": s, "kind": kind, "microbatch": mb, "chunk": c,
                           "start": t0 + start / 100, "end": t0 + end / 100})
    return events


def test_plot_metrics_overlays_runs_and_keeps_last_record(tmp_path, capsys):
    for name, offset in (("a", 0.0), ("b", 0.4)):
        os.makedirs(tmp_path / name)
        write_metrics(tmp_path / name / "metrics.jsonl", offset, resumed_from=60 if name == "a" else None)
    run = plot_metrics.load_run(str(tmp_path / "a" / "metrics.jsonl"))
    assert len(run["train"]) == 100 and run["train"][80]["lm_loss"] == 1.0 and run["train"][60]["lm_loss"] > 2
    assert sorted(run["valid"]) == [25, 50, 75, 100] and len(run["events"]) == 3
    assert "skipped 1 unreadable" in capsys.readouterr().err
    assert plot_metrics.labels_for(["x/a/metrics.jsonl", "x/b/metrics.jsonl"]) == ["a", "b"]
    out = tmp_path / "curves.png"
    assert plot_metrics.main([str(tmp_path / "a" / "metrics.jsonl"), str(tmp_path / "b" / "metrics.jsonl"),
                              "--out", str(out)]) == 0
    assert_png(out)


def test_plot_metrics_user_mistakes(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for argv, needle in (([str(tmp_path / "missing.jsonl")], "file not found"),
                         ([str(empty)], "no training or validation records"),
                         ([str(empty), "--out", str(tmp_path / "no" / "x.png")], "does not exist")):
        argv = argv if "--out" in argv else argv + ["--out", str(tmp_path / "x.png")]
        assert plot_metrics.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_bubble_of_simulated_1f1b_matches_the_formula():
    p, m = 4, 8
    events = simulate(p, m)
    assert len(events) == 2 * p * m
    bubbles = plot_pipeline.bubble_fractions(events)
    ideal = (p - 1) / (m + p - 1)
    assert plot_pipeline.ideal_bubble(events) == pytest.approx(ideal)
    assert all(b == pytest.approx(ideal, abs=1e-6) for b in bubbles.values()), bubbles
    assert plot_pipeline.busy_time([(0, 2), (1, 3), (5, 6)]) == 4  # overlaps count once


def test_plot_pipeline_reads_file_and_per_rank_files(tmp_path, capsys):
    events = simulate(4, 8)
    single = tmp_path / "trace.jsonl"
    single.write_text("".join(json.dumps(e) + "\n" for e in events) + "garbage\n")
    assert plot_pipeline.main([str(single), "--out", str(tmp_path / "one.png")]) == 0
    assert_png(tmp_path / "one.png")
    assert "skipped 1 lines" in capsys.readouterr().err

    per_rank = tmp_path / "per_rank"
    per_rank.mkdir()
    for rank in range(4):
        (per_rank / f"trace.rank{rank}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in events if e["rank"] == rank))
    for arg in ("trace", "trace.jsonl"):
        files = plot_pipeline.trace_files(str(per_rank / arg))
        assert len(files) == 4
    assert len(plot_pipeline.trace_files(str(per_rank))) == 4
    interleaved = tmp_path / "vpp.jsonl"
    interleaved.write_text("".join(json.dumps(e) + "\n" for e in simulate(4, 6, chunks=2)))
    assert plot_pipeline.main([str(interleaved), "--out", str(tmp_path / "vpp.png")]) == 0
    assert_png(tmp_path / "vpp.png")

    assert plot_pipeline.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no trace found" in err and len(err.splitlines()) == 1


def test_plot_pipeline_draws_one_traced_iteration(tmp_path, capsys):
    slow_first = [{**e, "iteration": 1, "end": e["end"] + 5.0} for e in simulate(2, 4)]
    second = [{**e, "iteration": 2, "start": e["start"] + 10.0, "end": e["end"] + 10.0} for e in simulate(2, 4)]
    picked, it = plot_pipeline.select_iteration(slow_first + second, None)
    assert it == 2 and picked == second
    assert plot_pipeline.select_iteration(slow_first + second, 1)[0] == slow_first
    assert plot_pipeline.select_iteration(simulate(2, 4), None)[1] is None
    # a resumed run appends its events: an iteration both runs traced is drawn from the later one
    again = [{**e, "run": 2.0, "end": e["end"] + 1.0} for e in second]
    assert plot_pipeline.select_iteration([{**e, "run": 1.0} for e in second] + again, None) == (again, 2)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in slow_first + second))
    assert plot_pipeline.main([str(trace), "--out", str(tmp_path / "p.png")]) == 0
    assert "mean bubble 20.0%" in capsys.readouterr().out  # (p-1)/(m+p-1) of iteration 2 alone
    assert plot_pipeline.main([str(trace), "--out", str(tmp_path / "p.png"), "--iteration", "7"]) == 2
    assert "traced iterations: 1, 2" in capsys.readouterr().err


def _engine_trace(name, p, m, vpp=None, t=(1.0, 1.0, 1.0), jitter=0.0, run_stamps=None):
    """Trace events of the engine's own `name` order on p ranks, replayed at per-pass times t (F, B, W) with
    free communication; `jitter`: a wait of that long before every other pass of a rank, later passes moved on
    (a busy CPU); `run_stamps`: one "run" per rank."""
    from engine.layout import PipelineSchedule
    from engine.pipeline.replay import replay
    from engine.pipeline.schedules import schedule_order
    schedule = PipelineSchedule.of(name, p, vpp)
    orders = [schedule_order(schedule, r, m) for r in range(p)]
    times = replay(orders, schedule, dict(zip("FBW", t)))
    events, passes = [], [0] * p
    for (kind, r, c, mb), (start, end) in sorted(times.items(), key=lambda kv: kv[1]):
        shift = jitter * (passes[r] // 2 + passes[r] % 2)
        passes[r] += 1
        events.append(dict(iteration=1, rank=r, pp_rank=r, kind=kind, microbatch=mb, chunk=c, start=start + shift,
                           end=end + shift, run=(run_stamps or [0.0] * p)[r]))
    return events


def test_zero_bubble_traces_are_named_and_compared_with_their_own_ideal(tmp_path, capsys):
    """The title and the summary name the traced schedule and its own ideal (ZB-V's, not interleaved 1F1B's);
    --replay redraws the traced order at the mean pass times, which a busy CPU's trace needs to be readable."""
    zbv = _engine_trace("zb-v", 4, 8)
    assert plot_pipeline.traced_schedule(zbv).name == "zb-v"
    assert plot_pipeline.traced_schedule(_engine_trace("zb-h1", 4, 8)).name == "zb-h1"
    assert plot_pipeline.traced_schedule(simulate(4, 8, chunks=2)).name == "interleaved"
    assert plot_pipeline.traced_schedule(simulate(4, 8)).name == "1f1b"
    interleaved_formula = (4 - 1) / (2 * 8 + 4 - 1)
    assert plot_pipeline.ideal_bubble(zbv) < interleaved_formula / 2  # ZB-V at F = B = W is near zero-bubble
    noisy = _engine_trace("zb-v", 4, 8, jitter=3.0)
    trace = tmp_path / "zbv.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in noisy))
    assert plot_pipeline.main([str(trace), "--out", str(tmp_path / "measured.png")]) == 0
    out = capsys.readouterr().out
    assert "zb-v" in out and "--replay draws the traced order" in out
    assert plot_pipeline.main([str(trace), "--out", str(tmp_path / "replayed.png"), "--replay"]) == 0
    out = capsys.readouterr().out
    assert "replayed" in out and "--replay draws" not in out
    assert_png(tmp_path / "replayed.png")
    replayed = plot_pipeline.bubble_fractions(plot_pipeline.replayed(noisy))
    assert sum(replayed.values()) / 4 == pytest.approx(plot_pipeline.ideal_bubble(noisy))


def test_every_rank_is_drawn_when_each_stamps_its_own_run():
    """Each rank stamps "run" with its own start time: an iteration keeps every rank's latest run, not only the
    rank whose stamp is largest (which drew one rank of a two-rank trace)."""
    events = _engine_trace("1f1b", 2, 4, run_stamps=[100.0, 100.03])
    resumed_earlier = [dict(e, run=e["run"] - 50.0, start=e["start"] - 60.0) for e in events]
    chosen, it = plot_pipeline.select_iteration(resumed_earlier + events, None)
    assert it == 1 and {e["rank"] for e in chosen} == {0, 1} and len(chosen) == len(events)

"""MoE checkpoints across expert-parallel sizes, under torchrun: experts are stored by global expert id, so a
run saved at ep 4 resumes at ep 2, and that one's checkpoint at ep 1, optimizer state (distributed, sharded
over the experts' replicas) and expert biases included; the losses continue the uninterrupted curve.
Budget: three small torchrun jobs, about 30 s.
"""
import pytest

from test_trainer import TINY, checkpoint_holding, last_train_records, launch, read_records

MODEL = TINY + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                "--num-query-groups", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
                "--train-iters", "14", "--use-distributed-optimizer", "--save-interval", "4",
                "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01"]


def _records(metrics) -> dict:
    return last_train_records(read_records(str(metrics)))


@pytest.mark.slow
def test_resume_ep4_to_ep2_to_ep1_continues_the_curve(tmp_path):
    code, out, _ = launch(MODEL + ["--ep", "4", "--save", str(tmp_path / "a"),
                                   "--metrics-file", str(tmp_path / "a.jsonl")], 4, timeout=180)
    assert code == 0, out[-6000:]
    assert "(ep 4: 1 of 4 experts per rank)" in out and "expert load max/mean" in out
    want = _records(tmp_path / "a.jsonl")
    assert sorted(want) == list(range(1, 15)) and want[14]["lm_loss"] < want[1]["lm_loss"]

    (tmp_path / "b").mkdir()
    code, out, _ = launch(MODEL + ["--ep", "2", "--load", str(checkpoint_holding(tmp_path / "a", 4, tmp_path / "b")),
                                   "--save", str(tmp_path / "b-save"), "--metrics-file", str(tmp_path / "b.jsonl")],
                          2, timeout=180)
    assert code == 0, out[-6000:]
    got = _records(tmp_path / "b.jsonl")
    assert sorted(got) == list(range(5, 15))
    assert max(abs(got[i]["lm_loss"] - want[i]["lm_loss"]) for i in got) <= 1e-4, (got, want)
    assert all(got[i]["moe_max_load"] == pytest.approx(want[i]["moe_max_load"]) for i in got)

    (tmp_path / "c").mkdir()
    code, out, _ = launch(MODEL + ["--load", str(checkpoint_holding(tmp_path / "b-save", 8, tmp_path / "c")),
                                   "--metrics-file", str(tmp_path / "c.jsonl")], 1, timeout=180)
    assert code == 0, out[-6000:]
    got = _records(tmp_path / "c.jsonl")
    assert sorted(got) == list(range(9, 15))
    assert max(abs(got[i]["lm_loss"] - want[i]["lm_loss"]) for i in got) <= 1e-4, (got, want)

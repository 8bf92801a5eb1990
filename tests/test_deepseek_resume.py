"""A DeepSeek-V3-shaped run (configs/deepseek-v3-tiny.yaml, shrunk: MLA with a q latent and YaRN, group-limited
sigmoid routing with an expert bias, the first layer dense, a shared expert, one MTP module) under torchrun with
Megatron-LM's flags: saved at ep 4 it resumes at ep 2 x cp 2, and that one's checkpoint on one rank (ep 1, cp 1);
the LM and MTP loss curves continue the uninterrupted ones within 1e-4 and the expert loads exactly. Budget: three
small torchrun jobs, about 40 s (slow).
"""
import pytest

from test_trainer import checkpoint_holding, last_train_records, launch, read_records

MODEL = ["--config", "configs/deepseek-v3-tiny.yaml", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
         "--seq-length", "32", "--max-position-embeddings", "32", "--log-interval", "1", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--train-iters", "12", "--save-interval", "4", "--use-distributed-optimizer",
         "--moe-layer-freq", "[0,1]", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8", "--moe-ffn-hidden-size", "16",
         "--moe-shared-expert-intermediate-size", "16", "--ffn-hidden-size", "64", "--original-max-position-embeddings",
         "8"]


def _records(metrics) -> dict:
    return last_train_records(read_records(str(metrics)))


def _run(tmp_path, name: str, extra: list, nproc: int, load=None) -> dict:
    args = MODEL + extra + ["--save", str(tmp_path / name), "--metrics-file", str(tmp_path / f"{name}.jsonl")]
    code, out, _ = launch(args + (["--load", str(load)] if load else []), nproc, timeout=240)
    assert code == 0, out[-6000:]
    assert "mtp loss:" in out and "expert load max/mean" in out
    return _records(tmp_path / f"{name}.jsonl")


def _continues(got: dict, want: dict) -> None:
    assert max(abs(got[i]["lm_loss"] - want[i]["lm_loss"]) for i in got) <= 1e-4, (got, want)
    assert max(abs(got[i]["mtp_loss"] - want[i]["mtp_loss"]) for i in got) <= 1e-4, (got, want)
    assert all(got[i]["moe_max_load"] == want[i]["moe_max_load"] for i in got)


@pytest.mark.slow
def test_resume_ep4_to_ep2_cp2_to_one_rank_continues_the_curves(tmp_path):
    want = _run(tmp_path, "a", ["--ep", "4"], 4)
    assert sorted(want) == list(range(1, 13)) and want[12]["lm_loss"] < want[1]["lm_loss"]
    assert want[12]["mtp_loss"] < want[1]["mtp_loss"]

    (tmp_path / "b-load").mkdir()
    got = _run(tmp_path, "b", ["--ep", "2", "--cp", "2"], 4, checkpoint_holding(tmp_path / "a", 4, tmp_path / "b-load"))
    assert sorted(got) == list(range(5, 13))
    _continues(got, want)

    (tmp_path / "c-load").mkdir()
    got = _run(tmp_path, "c", [], 1, checkpoint_holding(tmp_path / "b", 8, tmp_path / "c-load"))
    assert sorted(got) == list(range(9, 13))
    _continues(got, want)

"""The launcher with data and flag mistakes (issue 21): one line from rank 0, a notice when a config's
mock_data gives way to --data-path, and the data summary printed once.

Under torchrun each worker exits 2 after rank 0 printed the line; torchrun then exits 1 (its convention).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.data import IndexedDatasetWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR = "pretrain_gpt.py: error:"


def launch(args, nproc=None, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc else [sys.executable]
    proc = subprocess.run([*runner, "launch/pretrain_gpt.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, (proc.stdout + proc.stderr).splitlines()


def write(prefix, docs):
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return str(prefix)


def test_an_unknown_flag_is_one_line_from_rank_0_without_the_usage():
    proc, lines = launch(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--sequence-paralel"], nproc=2)
    ours = [line for line in lines if line.startswith(ERROR)]
    assert ours == [f"{ERROR} unknown flag --sequence-paralel; did you mean --sequence-parallel? "
                    "(python launch/pretrain_gpt.py --help lists them)"], proc.stderr
    assert "usage:" not in proc.stdout + proc.stderr and "exitcode  : 2" in proc.stderr


@pytest.mark.slow  # a torchrun job that trains: ~5 s
def test_data_path_beats_a_configs_mock_data_and_the_summary_is_printed_once(tmp_path):
    config = tmp_path / "tiny-mock.yaml"
    config.write_text(open(os.path.join(ROOT, "configs", "gpt-tiny.yaml")).read() + "mock_data: true\n")
    data = write(tmp_path / "two", [np.arange(3, 13), np.arange(20, 30)])  # 2 documents of 10 tokens
    proc, lines = launch(["--config", str(config), "--data-path", data, "--split", "1,0,0", "--train-iters", "2",
                          "--num-layers", "2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notices = [line for line in lines if line.startswith("pretrain_gpt.py: note:")]
    assert notices == [f"pretrain_gpt.py: note: --data-path given: training on {data}, not on the synthetic tokens "
                       f"that mock_data: true in {config} asks for (pass --mock-data for those)"]
    summary = [line for line in lines if line.startswith("data:")]
    # the trainer asks for 2 iterations x 16 samples of 64 tokens: 2,049 tokens from 20
    assert summary == [f"data: {data}: 2 documents, 20 tokens; train 2 documents, 20 tokens: 32 samples need 102 "
                       "epochs"]
    warnings = [line for line in lines if line.startswith("warning: data:")]
    assert len(warnings) == 1 and "102 times over" in warnings[0]
    assert not any("synthetic tokens (--mock-data)" in line for line in lines)


def test_bad_data_ends_the_run_before_any_process_group_with_one_line(tmp_path):
    wide = write(tmp_path / "wide", [np.array([5, 900, 2]), np.arange(3, 40)])
    empty = write(tmp_path / "empty", [])
    tiny = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "2", "--train-iters", "1"]
    cases = [
        (["--data-path", wide], f"--data-path {wide}: {wide}.bin holds token id 900 but the vocabulary has 256 ids "
                                "(--vocab-size 256); give the tokenizer the data was made with (--tokenizer-model "
                                "FILE.model) or a --vocab-size above 900"),
        (["--data-path", "1", wide, "1", empty, "--vocab-size", "1024"],
         f"--data-path {empty}: {empty}.bin holds no tokens (0 documents); make it again with "
         "tools/preprocess_data.py (check --input and --json-keys) or leave it out"),
        (["--data-path", "nan", wide, "1", wide, "--vocab-size", "1024"],
         "--data-path nan: each blend weight must be a finite non-negative number (e.g. 0.7)"),
    ]
    for args, line in cases:
        proc, lines = launch(tiny + args)
        assert proc.returncode == 2 and [x for x in lines if x.startswith(ERROR)] == [f"{ERROR} {line}"], proc.stderr
        assert "Traceback" not in proc.stderr

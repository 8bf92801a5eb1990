"""The tools' --out (issue 37): merge_ckpt.py and convert_hf.py refuse a directory a running job holds as its --save,
fail in one line on an unusable or full --out and leave no `.tmp` (nor a directory they made) behind; convert_hf.py
checks the config it reads; the --save lock words a reused pid and a half-written lock truthfully. One process,
about 5 s.
"""
import errno
import importlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_hf_moe import moe_config

from engine.checkpoint import files
from engine.checkpoint.hf import hf_config
from engine.run.lock import LOCK_FILE, RunLock, _proc_start


def _tool(name, argv):
    return importlib.import_module(f"tools.{name}").main(argv)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from engine.checkpoint import save_checkpoint
    from engine.parallel.topology import ParallelContext
    from engine.pipeline.partition import build_model_chunks
    root = tmp_path_factory.mktemp("tools_out")
    cfg = moe_config()
    ctx = ParallelContext.virtual()
    save_checkpoint(str(root / "save"), 1, build_model_chunks(cfg, ctx, vocab_size=100), None, ctx, cfg, {})
    return root / "save"


def _one_line(capsys, tool):
    err = capsys.readouterr().err
    assert err.startswith(f"{tool}.py: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_merge_refuses_the_save_directory_of_a_running_job(saved, tmp_path, capsys):
    running = tmp_path / "running"
    with RunLock(str(running)):  # this process plays the job
        assert _tool("merge_ckpt", ["--load", str(saved), "--out", str(running)]) == 2
        err = _one_line(capsys, "merge_ckpt")
        assert f"--out {running} is in use by another job (host {socket.gethostname()}, pid {os.getpid()}" in err
        assert sorted(os.listdir(running)) == [LOCK_FILE]


@pytest.mark.parametrize("how", ["merge", "split", "hf"])
def test_a_full_out_is_one_line_and_leaves_nothing(saved, tmp_path, capsys, monkeypatch, how):
    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(files, "write_safetensors", full)
    out = tmp_path / "out"
    extra = {"merge": [], "split": ["--target-tp", "1", "--target-pp", "2"], "hf": ["--format", "hf"]}[how]
    assert _tool("merge_ckpt", ["--load", str(saved), "--out", str(out)] + extra) == 2
    err = _one_line(capsys, "merge_ckpt")
    assert f"--out {out}: writing failed (No space left on device); free space or choose a writable directory" in err
    assert not out.exists()  # made by the tool, removed again: no .tmp, no lock


def test_an_unusable_out_is_one_line(saved, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert _tool("merge_ckpt", ["--load", str(saved), "--out", str(tmp_path / "file" / "out")]) == 2
    assert "cannot create the directory (Not a directory)" in _one_line(capsys, "merge_ckpt")


def test_convert_hf_checks_the_experts_per_token_against_the_experts(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = hf_config("mixtral", moe_config())
    config["num_experts_per_tok"] = 5
    (hf / "config.json").write_text(json.dumps(config))
    assert _tool("convert_hf", ["--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    err = _one_line(capsys, "convert_hf")
    assert "config.json: num_experts_per_tok 5 must be between 1 and num_local_experts 4" in err
    assert not (tmp_path / "out").exists()


def test_convert_hf_into_a_full_out_leaves_nothing(tmp_path, capsys, monkeypatch, saved):
    assert _tool("merge_ckpt", ["--load", str(saved), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(files, "write_safetensors", full)
    out = tmp_path / "existing"
    out.mkdir()
    assert _tool("convert_hf", ["--hf", str(tmp_path / "hf"), "--out", str(out)]) == 2
    assert "writing failed (No space left on device)" in _one_line(capsys, "convert_hf")
    assert os.listdir(out) == []  # its own directory stays, empty: no iter_0000000.tmp, no lock


def _lock(path, **info):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, LOCK_FILE), "w") as fh:
        fh.write(json.dumps(info) if info else '{"host": "')


def test_lock_lines_say_a_pid_was_reused_and_how_old_a_half_written_lock_is(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # the holder's pid now runs another process (a different start time)
        _lock(str(tmp_path / "a"), host=socket.gethostname(), pid=other.pid, started="earlier",
              proc_start=str(int(_proc_start(other.pid)) - 1))
        lines = []
        RunLock(str(tmp_path / "a"), log=lines.append).acquire().release()
        assert len(lines) == 1 and f"pid {other.pid} now belongs to another process" in lines[0], lines
    finally:
        other.kill()
        other.wait()
    _lock(str(tmp_path / "b"))
    old = time.time() - 125
    os.utime(tmp_path / "b" / LOCK_FILE, (old, old))
    lines = []
    RunLock(str(tmp_path / "b"), log=lines.append).acquire().release()
    assert len(lines) == 1 and "the lock file is half-written, last written 125 s ago" in lines[0], lines

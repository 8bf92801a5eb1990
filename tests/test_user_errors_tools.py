"""tools/generate.py on a partial or empty checkpoint directory (issue 21): one accurate line, no advice
about flags the tool does not have (--ckpt-fallback, --iteration)."""
import importlib

import pytest
from test_checkpoint_tools import _tiny

from engine.checkpoint import save_checkpoint


def _generate(argv):
    return importlib.import_module("tools.generate").main(argv)


def test_generate_names_what_is_missing_and_only_advises_what_it_can_do(tmp_path, capsys):
    empty, save = tmp_path / "empty", tmp_path / "save"
    empty.mkdir()
    assert _generate(["--load", str(empty), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == (
        f"generate.py: error: --load {empty}: holds neither a merged checkpoint (model.safetensors + config.json) "
        "nor a run's checkpoints (iter_NNNNNNN folders); give a tools/merge_ckpt.py --out folder or a run's --save "
        "directory\n")
    cfg, ctx, chunks, opt = _tiny(hidden=16, layers=1)
    for it in (4, 8):
        save_checkpoint(str(save), it, chunks, opt, ctx, cfg, {})
    (save / "latest_checkpointed_iteration.txt").unlink()
    assert _generate(["--load", str(save), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == (
        f"generate.py: error: --load {save}: latest_checkpointed_iteration.txt is missing or unreadable (a save did "
        "not finish?); saved iterations: 4, 8; merge one with tools/merge_ckpt.py --iteration N and --load its --out\n")
    (save / "latest_checkpointed_iteration.txt").write_text("8")
    (save / "iter_0000008" / "metadata.json").unlink()
    assert _generate(["--load", str(save), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"generate.py: error: checkpoint {save}/iter_0000008 is incomplete: ")
    assert err.count("\n") == 1
    assert "--ckpt-fallback" not in err and "pass --iteration" not in err


def test_generate_answers_an_unknown_flag_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        _generate(["--load", "x", "--prompt", "y", "--top_k", "3"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("generate.py: error: unknown flag --top_k; did you mean --top-k? "
                                       "(python tools/generate.py --help lists them)\n")

"""tools/train_tokenizer.py, tools/preprocess_data.py and the demo corpus, run as users run them."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from demo_corpus import build_demo_corpus, stdlib_sources

from engine.data import IndexedDataset, Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box jaunty "
         "nymphs near 2048 bright lamps and 31 old towers").split()


def run_tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small JSONL corpus with a duplicate, a short document, a symbol-heavy one and a broken line."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 80)))) for _ in range(300)]
    texts.append(texts[10].upper().replace(" ", "  "))  # duplicate after normalisation
    texts.append("too short")
    texts.append("#$%& {}[]<> ;;;; @@@@ ~~~ !!! ??? a b c d e f g h i j k l m n o p")
    path = d / "corpus.jsonl"
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "title": t[:12]}) + "\n")
        f.write("{not json\n")
    result = run_tool("train_tokenizer.py", "--input", path, "--vocab-size", 400, "--model-prefix", d / "tok")
    assert result.returncode == 0, result.stderr
    (d / "train_tokenizer.stderr").write_text(result.stderr)  # its progress bars
    return d, path, texts, result.stdout


def test_tokenizer_training_specials_roundtrip_and_fertility(corpus):
    d, _, _, stdout = corpus
    assert "fertility:" in stdout and "3 held-out documents" in stdout
    fert = float(stdout.split("fertility:")[1].split()[0])
    assert 1.0 <= fert < 3.0
    tok = Tokenizer(str(d / "tok.model"))
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, 3) and tok.vocab_size <= 400
    text = "the  lazy\tdog 12345 naïve ☃ 漢字\nnext line"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte fallback and no normalisation: lossless
    pieces = tok.sp.id_to_piece(tok.encode("2048"))
    assert [p for p in pieces if p != "▁"] == ["2", "0", "4", "8"]  # digits split


def test_preprocess_matches_direct_encoding_with_eod(corpus, tmp_path):
    d, path, texts, _ = corpus
    out = tmp_path / "out"
    result = run_tool("preprocess_data.py", "--input", path, "--json-keys", "text", "title",
                      "--tokenizer-model", d / "tok.model", "--output-prefix", out, "--workers", 2,
                      "--append-eod", "--quiet")
    assert result.returncode == 0, result.stderr
    tok = Tokenizer(str(d / "tok.model"))
    for key in ("text", "title"):
        ds = IndexedDataset(f"{out}_{key}_document")
        assert len(ds) == len(texts) and ds.dtype == np.uint16
        for i in (0, 1, 150, len(texts) - 1):
            expected = tok.encode(texts[i] if key == "text" else texts[i][:12]) + [tok.eod]
            assert ds[i].tolist() == expected
    assert "dropped 1: malformed JSON or missing key" in result.stdout


def test_preprocess_ends_its_workers_by_telling_them_to_finish_not_by_sigterm(corpus, tmp_path):
    """The tokenizing pool's workers are told to finish and waited for before the pool is left; leaving a pool with
    workers alive ends them by SIGTERM. There, a worker waiting for the task queue's lock that the pool's own
    shutdown took never reads its stop and must be killed, and a process whose SIGTERM handler does not exit (a
    trainer's stop-signal handler, which a test once left installed in a pytest worker, and which forked workers
    inherit) waits on it for ever: the suite hung so on 2026-11-27. Checked in a process of its own, with such a
    handler: no worker is left alive when the pool is left, and the run ends (killed with every worker it forked
    if it outlives its time)."""
    import signal
    d, path, texts, _ = corpus
    code = (f"import signal; signal.signal(signal.SIGTERM, lambda *a: None)\n"
            f"import multiprocessing.pool as pools\n"
            f"alive, terminate = [], pools.Pool.terminate\n"
            f"pools.Pool.terminate = lambda self: (alive.append(sum(p.is_alive() for p in self._pool)), "
            f"terminate(self))\n"
            f"from engine.data.preprocess import Options, preprocess\n"
            f"s = preprocess([{str(path)!r}], {str(d / 'tok.model')!r}, {str(tmp_path / 'out')!r}, Options(), "
            f"workers=4, progress=False)\n"
            f"print('kept', s.kept, 'alive when left', alive)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and the pool workers it forked
        proc.communicate()
        pytest.fail("preprocess never returned: its pool waited on workers that SIGTERM does not end")
    assert proc.returncode == 0 and f"kept {len(texts)} alive when left [0]" in out, (out, err[-2000:])


def test_preprocess_plain_text_has_one_document_per_line(corpus, tmp_path):
    d, _, texts, _ = corpus
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(texts[:20]) + "\n\n")
    out = tmp_path / "plain"
    result = run_tool("preprocess_data.py", "--input", path, "--tokenizer-model", d / "tok.model",
                      "--output-prefix", out, "--quiet")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(f"{out}_text_document")
    tok = Tokenizer(str(d / "tok.model"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in texts[:20]]  # no EOD asked


def test_preprocess_dedup_and_filters_are_counted(corpus, tmp_path):
    d, path, texts, _ = corpus
    out = tmp_path / "filtered"
    result = run_tool("preprocess_data.py", "--input", path, "--tokenizer-model", d / "tok.model",
                      "--output-prefix", out, "--workers", 1, "--append-eod", "--dedup", "--min-words", 5,
                      "--max-symbol-ratio", 0.3, "--quiet")
    assert result.returncode == 0, result.stderr
    assert "dropped 1: duplicate" in result.stdout
    assert "dropped 1: fewer than 5 words" in result.stdout
    assert "dropped 1: symbol ratio above 0.3" in result.stdout
    assert len(IndexedDataset(f"{out}_text_document")) == len(texts) - 3


def test_tools_report_user_mistakes_in_one_line(corpus, tmp_path):
    d, path, _, _ = corpus
    cases = [
        ("preprocess_data.py", ["--input", path, "--tokenizer-model", tmp_path / "none.model",
                                "--output-prefix", tmp_path / "x"], "--tokenizer-model"),
        ("preprocess_data.py", ["--input", tmp_path / "none.jsonl", "--tokenizer-model", d / "tok.model",
                                "--output-prefix", tmp_path / "x"], "--input"),
        ("preprocess_data.py", ["--input", path, "--tokenizer-model", d / "tok.model",
                                "--output-prefix", tmp_path / "no" / "x"], "--output-prefix"),
        ("preprocess_data.py", ["--input", path, "--tokenizer-model", path, "--output-prefix", tmp_path / "x"],
         "not a SentencePiece model"),
        ("train_tokenizer.py", ["--input", path, "--vocab-size", 100, "--model-prefix", tmp_path / "t"],
         "--vocab-size"),
    ]
    for tool, args, flag in cases:
        result = run_tool(tool, *args)
        assert result.returncode == 2, (tool, args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and flag in lines[0] and "Traceback" not in result.stderr


def test_demo_corpus_builds_from_stdlib_and_is_cached(tmp_path):
    model, prefix = build_demo_corpus(str(tmp_path), vocab_size=512, max_files=25)
    tok = Tokenizer(model)
    ds = IndexedDataset(prefix)
    assert len(ds) == 25 and ds.num_tokens > 10_000
    with open(stdlib_sources(25)[0], encoding="utf-8") as f:
        assert tok.decode(ds[0].tolist()[:-1]) == f.read()
    assert ds[0][-1] == tok.eod
    built = {p: os.path.getmtime(p) for p in (model, prefix + ".bin", prefix + ".idx")}
    assert build_demo_corpus(str(tmp_path), vocab_size=512, max_files=25) == (model, prefix)
    assert {p: os.path.getmtime(p) for p in built} == built, "a second call must reuse the cached corpus"


ETA = re.compile(r"\[\d\d:\d\d<\d\d:\d\d")  # tqdm's [elapsed<remaining]


def test_tokenizer_training_and_preprocessing_show_progress_with_an_eta(corpus, tmp_path):
    d, path, _, _ = corpus
    bars = (d / "train_tokenizer.stderr").read_text()
    for name, eta in (("reading input", True), ("BPE merges", False)):  # this small run merges too few for an ETA
        shown = [part for part in re.split(r"[\r\n]", bars) if part.startswith(name)]
        assert shown and "100%" in shown[-1] and (ETA.search(shown[-1]) or not eta), bars
    result = run_tool("preprocess_data.py", "--input", path, "--tokenizer-model", d / "tok.model",
                      "--output-prefix", tmp_path / "bar")
    assert result.returncode == 0, result.stderr
    last = [p for p in re.split(r"[\r\n]", result.stderr) if p.startswith("tokenizing")][-1]
    assert "100%" in last and ETA.search(last) and "304 documents" in last, result.stderr


def test_a_missing_json_key_or_an_empty_output_is_one_line_and_writes_nothing(corpus, tmp_path):
    d, path, _, _ = corpus
    out = tmp_path / "x"
    missing = "--json-keys body: the first record of {} has no key 'body' (its keys: 'text', 'title')".format(path)
    for tool, args in (("preprocess_data.py", ["--tokenizer-model", d / "tok.model", "--output-prefix", out]),
                       ("train_tokenizer.py", ["--vocab-size", 400, "--model-prefix", out])):
        result = run_tool(tool, "--input", path, "--json-keys", "body", *args)
        assert result.returncode == 2 and result.stderr == f"{tool}: error: {missing}\n", result.stderr
    result = run_tool("preprocess_data.py", "--input", path, "--tokenizer-model", d / "tok.model",
                      "--output-prefix", out, "--min-words", 10_000, "--quiet")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("preprocess_data.py: error: no tokens to write: 304 documents read from ")
    assert "0 kept (303 fewer than 10000 words, 1 malformed JSON or missing key)" in result.stderr
    assert os.listdir(tmp_path) == [], "nothing a training run could pick up is left behind"


def test_tool_parsers_answer_an_unknown_flag_in_one_line(corpus, tmp_path):
    d, path, _, _ = corpus
    result = run_tool("preprocess_data.py", "--input", path, "--tokenizer-model", d / "tok.model",
                      "--output-prefix", tmp_path / "x", "--json-kyes", "text")
    assert result.returncode == 2 and result.stderr == (
        "preprocess_data.py: error: unknown flag --json-kyes; did you mean --json-keys? "
        "(python tools/preprocess_data.py --help lists them)\n")


def test_the_merges_bar_follows_sentencepieces_log_with_an_eta(capfd):
    import time

    from engine.data.tokenizer_training import TrainingProgress
    progress = TrainingProgress(input_bytes=1000, vocab_size=1300)
    with progress:
        progress.read(1000)
        os.write(2, b"I0000 00:00:1.0  1 trainer_interface.cc:601] Alphabet size=40\n")
        for done in (100, 200, 300):  # sentencepiece 0.2's line every 100 merges
            os.write(2, b"I0000 00:00:1.0  1 bpe_model_trainer.cc:421] Merged: freq=9 merges=%d piece=ab\n" % done)
            time.sleep(0.25)
        os.write(2, b"E0000 00:00:1.0  1 trainer.cc:1] something failed\n")
    err = capfd.readouterr().err
    merges = [p for p in re.split(r"[\r\n]", err) if p.startswith("BPE merges")]
    assert merges and "/1000 " in merges[-1] and "300/1000" in err, err  # 1300 - 256 bytes - 4 specials - 40 chars
    assert any(ETA.search(p) for p in merges), err
    assert progress.errors == ["something failed"] and "Merged:" not in err
    os.write(2, b"back on stderr\n")
    assert capfd.readouterr().err == "back on stderr\n"

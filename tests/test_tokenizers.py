"""--tokenizer-type (issue 15): Megatron-LM's four tokenizers, each run as a user runs it on a small real corpus
(Python standard-library sources): tools/preprocess_data.py, three iterations of launch/pretrain_gpt.py, then
tools/generate.py and the transformers export, whose AutoTokenizer must give the ids the run trained on.

The tokenizers are made here: a SentencePiece BPE (tools' own trainer), a GPT-2 byte-level BPE (vocab.json +
merges.txt) and a transformers tokenizer directory whose post-processor adds a BOS (as Llama 3's does), both
trained with the `tokenizers` library; the NullTokenizer reads the SentencePiece ids written out as text.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from demo_corpus import stdlib_sources

from engine.cli import parse_config
from engine.config import ConfigError
from engine.data import IndexedDataset
from engine.data.tokenizer_spec import tokenizer_spec
from engine.data.tokenizer_training import train_sentencepiece
from engine.resolve import resolve
from engine.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
VOCAB = 500
# gpt-tiny is Llama-shaped; the GPT-2 BPE run trains a GPT-2-shaped model, so both exports are checked.
GPT2_SHAPE = ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--no-swiglu",
              "--no-disable-bias-linear", "--num-query-groups", "4"]
NOT_IDS = "12 seven 5"  # a NullTokenizer document that preprocessing drops and counts


def _bpe(texts, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _hf_directory(texts, path):
    """A tokenizer directory as transformers saves one: tokenizer.json with a BOS-adding post-processor."""
    from tokenizers import processors
    tok = _bpe(texts, ["<|begin_of_text|>", "<|end_of_text|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": False}, fh)


# The commands a user types one by one, run in one process so that torch is imported once for the four runs:
# tools/preprocess_data.py's and launch/pretrain_gpt.py's main() with each command line; each log ends "exit code N".
RUNNER = r"""
import contextlib, importlib.util, json, os, socket, sys
root, jobs = sys.argv[1], json.load(open(sys.argv[2]))
sys.path[:0] = [root, os.path.join(root, "tools")]
import preprocess_data
spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(root, "launch", "pretrain_gpt.py"))
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
for log, tool, argv in jobs:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = (preprocess_data if tool == "preprocess" else launcher).main(argv)
        except SystemExit as e:
            code = e.code
        print(f"exit code {code}")
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per type: its flags, TokenizerSpec, and the logs of preprocessing its corpus and a 3-iteration run."""
    d = tmp_path_factory.mktemp("tokenizers")
    texts = []
    for path in stdlib_sources(12):
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    sp = train_sentencepiece((line for t in texts for line in t.split("\n")), str(d / "sp"), VOCAB, num_threads=1)
    os.makedirs(d / "gpt2")
    _bpe(texts, ["<|endoftext|>"]).model.save(str(d / "gpt2"))
    _hf_directory(texts, str(d / "hf"))
    id_texts = [" ".join(map(str, sp.encode(t))) for t in texts]
    specs = {"SentencePieceTokenizer": tokenizer_spec(None, str(d / "sp.model")),
             "GPT2BPETokenizer": tokenizer_spec("GPT2BPETokenizer", None, str(d / "gpt2" / "vocab.json"),
                                                str(d / "gpt2" / "merges.txt")),
             "HuggingFaceTokenizer": tokenizer_spec("HuggingFaceTokenizer", str(d / "hf")),
             "NullTokenizer": tokenizer_spec("NullTokenizer", vocab_size=sp.vocab_size)}
    flags = {"SentencePieceTokenizer": ["--tokenizer-model", d / "sp.model"],  # the type implied, as before
             "GPT2BPETokenizer": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", d / "gpt2" / "vocab.json",
                                  "--merge-file", d / "gpt2" / "merges.txt"],
             "HuggingFaceTokenizer": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d / "hf"],
             "NullTokenizer": ["--tokenizer-type", "NullTokenizer", "--vocab-size", sp.vocab_size]}
    for name, docs in (("text", texts), ("ids", id_texts + [NOT_IDS])):
        with open(d / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    jobs = [(str(d / f"{kind}.preprocess.log"), "preprocess",
             ["--input", d / ("ids.jsonl" if kind == "NullTokenizer" else "text.jsonl"), *flags[kind],
              "--output-prefix", d / kind, "--append-eod", "--workers", 2, "--quiet"]) for kind in TYPES]
    jobs += [(str(d / f"{kind}.train.log"), "train",
              ["--config", "configs/gpt-tiny.yaml", "--num-layers", 2, "--train-iters", 3, "--global-batch-size", 4,
               "--log-interval", 3, *flags[kind], *(GPT2_SHAPE if kind == "GPT2BPETokenizer" else []),
               "--data-path", d / f"{kind}_text_document", "--save", d / f"run_{kind}"]) for kind in TYPES]
    (d / "jobs.json").write_text(json.dumps([(log, tool, [str(a) for a in argv]) for log, tool, argv in jobs]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, ROOT, str(d / "jobs.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import generate  # noqa: F401 - meanwhile, the imports the tests need (torch, transformers)
    import transformers  # noqa: F401
    output = runner.communicate(timeout=300)[0]
    assert runner.returncode == 0, output
    logs = {kind: tuple((d / f"{kind}.{step}.log").read_text() for step in ("preprocess", "train")) for kind in TYPES}
    return d, texts, id_texts, flags, specs, logs


@pytest.mark.parametrize("kind", TYPES)
def test_preprocess_train_generate_and_export_round_trip(runs, kind, tmp_path, capsys):
    import generate
    import merge_ckpt
    from transformers import AutoTokenizer
    d, texts, id_texts, _, specs, logs = runs
    prep, train = logs[kind]
    assert prep.endswith("exit code 0\n") and train.endswith("exit code 0\n"), prep + train[-3000:]
    assert "iteration        3/       3" in train
    docs = id_texts if kind == "NullTokenizer" else texts
    if kind == "NullTokenizer":
        assert "dropped 1: not whitespace-separated integer ids" in prep
    built = specs[kind].build()
    # The arguments are printed (and saved) re-resolvable: NullTokenizer's --vocab-size as given, the model then
    # holds one more id (its EOD); the other types print the tokenizer's vocabulary.
    shown = built.vocab_size - 1 if kind == "NullTokenizer" else built.vocab_size
    assert f"vocab_size {'.' * 38} {shown}\n" in train

    ds = IndexedDataset(str(d / f"{kind}_text_document"))
    assert len(ds) == len(docs) and {int(ds[i][-1]) for i in range(len(ds))} == {built.eod}
    assert [ds[i][:-1].tolist() for i in range(len(ds))] == built.encode_batch(docs)
    if kind == "HuggingFaceTokenizer":  # as Megatron-LM encodes with AutoTokenizer: the BOS its tokenizer adds
        assert {int(ds[i][0]) for i in range(len(ds))} == {built.bos} and built.bos is not None

    prompt = "12 7 99" if kind == "NullTokenizer" else "def main("
    assert generate.main(["--load", str(d / f"run_{kind}"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() and (kind != "NullTokenizer" or all(t.isdigit() for t in printed.split()))

    out = tmp_path / "hf"
    assert merge_ckpt.main(["--load", str(d / f"run_{kind}"), "--out", str(out), "--format", "hf"]) == 0
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf(docs)["input_ids"] == [ds[i][:-1].tolist() for i in range(len(ds))]  # the ids it trained on
    assert all(hf.decode(ds[i][:-1].tolist(), skip_special_tokens=True) == docs[i] for i in range(len(ds)))
    with open(out / "config.json") as fh:
        config = json.load(fh)
    assert config["eos_token_id"] == hf.eos_token_id == built.eod  # generate() stops at the end of a document
    from transformers import GenerationConfig
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == built.eod  # generation_config.json
    assert all(config[k] is not None and 0 <= config[k] < config["vocab_size"]
               for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    assert config["model_type"] == ("gpt2" if kind == "GPT2BPETokenizer" else "llama")


def test_a_bare_tokenizer_json_encodes_as_its_directory(runs, tmp_path):
    from transformers import AutoTokenizer
    d, texts = runs[:2]
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(d / "hf" / "tokenizer.json", alone / "tokenizer.json")  # no tokenizer_config.json: eos by name
    directory = tokenizer_spec("HuggingFaceTokenizer", str(d / "hf")).build()
    for path in (d / "hf" / "tokenizer.json", alone / "tokenizer.json"):
        bare = tokenizer_spec(None, str(path)).build()  # a .json file implies HuggingFaceTokenizer
        assert bare.encode_batch(texts) == directory.encode_batch(texts)
        assert (bare.bos, bare.eod, bare.vocab_size) == (directory.bos, directory.eod, directory.vocab_size)
    ids = bare.save_pretrained(str(tmp_path / "export"))
    assert ids["eos_token_id"] == directory.eod
    assert AutoTokenizer.from_pretrained(str(tmp_path / "export"))(texts)["input_ids"] == directory.encode_batch(texts)


def test_wrong_combinations_are_one_line_each(runs, tmp_path, capsys):
    import preprocess_data
    d = runs[0]
    vocab, merges = str(d / "gpt2" / "vocab.json"), str(d / "gpt2" / "merges.txt")
    null = str(d / "NullTokenizer_text_document")
    cases = [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab], "add --merge-file"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "add --vocab-file and --merge-file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", merges, "--merge-file", merges],
         f"--vocab-file {merges}: not a GPT-2 vocab.json"),
        (["--vocab-file", vocab, "--merge-file", vocab], f"--merge-file {vocab}: not a GPT-2 merges.txt"),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(d / "hf")],
         "a directory, not a SentencePiece .model file; use --tokenizer-type HuggingFaceTokenizer"),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(d / "hf" / "tokenizer.json")],
         "not a SentencePiece model; it looks like a Hugging Face tokenizer"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d / "sp.model")],
         "a SentencePiece model, not a tokenizer.json"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d / "gpt2")],
         "holds no tokenizer.json or tokenizer_config.json"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
        (["--tokenizer-model", str(d / "sp.model"), "--tokenizer-type", "SentencePieceTokenizer", "--merge-file", merges],
         "only --tokenizer-type GPT2BPETokenizer reads it"),
        (["--tokenizer-type", "NullTokenizer"], "needs --vocab-size N"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "8", "--tokenizer-model", str(d / "sp.model")],
         "NullTokenizer reads whitespace-separated integer ids"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],  # the data's top id is its EOD
         f"holds token id {runs[4]['NullTokenizer'].null_vocab} but the vocabulary has 101 ids (--tokenizer-type "
         "NullTokenizer --vocab-size 100 and its end-of-document id 100)"),
    ]
    for flags, needle in cases:
        with pytest.raises(ConfigError) as info:
            validate(parse_config(["--data-path", null, *flags]), 1)
        assert needle in str(info.value) and "\n" not in str(info.value), (flags, str(info.value))
    # The same checks answer in tools/preprocess_data.py, which also refuses --vocab-size for a type that sets it.
    for flags, needle in cases[:4] + [(["--tokenizer-model", str(d / "hf"), "--vocab-size", "9"], "--vocab-size 9")]:
        argv = ["--input", str(d / "text.jsonl"), "--output-prefix", str(tmp_path / "x"), *flags]
        assert preprocess_data.main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_null_tokenizer_vocabulary_resolves_once(runs):
    d, n = runs[0], runs[4]["NullTokenizer"].null_vocab
    cfg = parse_config(["--config", "configs/gpt-tiny.yaml", "--data-path", str(d / "NullTokenizer_text_document"),
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(n)])
    validate(cfg, 1)
    assert resolve(resolve(cfg, 1), 1).model.vocab_size == n + 1  # the launcher and the trainer both resolve


def test_every_tokenizer_type_is_one_registry_entry():
    """--tokenizer-type's choices (engine.config, which opens no file) and the registry that checks and opens each
    type (engine.data.tokenizer_spec) name the same types, in the same order."""
    from engine.config import TOKENIZER_TYPES
    from engine.data.tokenizer_spec import TYPES as REGISTRY
    assert tuple(REGISTRY) == TOKENIZER_TYPES == TYPES
    null = tokenizer_spec("NullTokenizer", vocab_size=7)  # the one type that opens no file
    assert (null.build().kind, null.vocab_size(), null.source) == ("NullTokenizer", 8, "--tokenizer-type NullTokenizer "
                                                                                       "--vocab-size 7")

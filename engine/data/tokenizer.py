"""Tokenizers: training a SentencePiece BPE model, and the wrappers the engine encodes and decodes with.

Training settings follow what makes a tokenizer lossless for pretraining: byte fallback (no unknown
text), digits split one per token, no text normalisation and no whitespace collapsing (so source code
round-trips), and fixed ids for the special tokens: unk 0, bos 1, eos (= end of document) 2, pad 3.
Training lives in tokenizer_training.py (with progress bars with an ETA: the input read, then the merges).

Tokenizers users bring, by `--tokenizer-type` with Megatron-LM's meaning (one class each; which files each
needs is checked in tokenizer_spec.py, whose registry maps the type to its class; a file that is not what the
type needs is one ConfigError line):
- SentencePieceTokenizer: `--tokenizer-model FILE.model`; end of document = the model's eos piece.
- GPT2BPETokenizer: `--vocab-file vocab.json --merge-file merges.txt` (byte-level BPE through the
  `tokenizers` library); end of document = `<|endoftext|>`, which text itself never produces.
- HuggingFaceTokenizer: `--tokenizer-model` a directory transformers saved a tokenizer to (loaded with
  AutoTokenizer, as Megatron-LM does: its special tokens, e.g. a BOS, are added) or a bare tokenizer.json
  (the `tokenizers` library); end of document = its eos token.
- NullTokenizer: text is whitespace-separated integer ids below `--vocab-size` N; N is the end of
  document, so the vocabulary holds N + 1 ids.
Every wrapper has `encode`, `encode_batch`, `decode`, `.vocab_size`, `.eod` (None when the tokenizer has
no end-of-document token), `.bos`, `.pad`, `.kind`, `.source` (the flags it came from, for messages) and
`save_pretrained(dir)`, which writes files that `transformers.AutoTokenizer.from_pretrained(dir)` loads
and that encode text to the same ids (through tokenizer_export.py).
"""
from __future__ import annotations

import json
import os

import sentencepiece as spm

from engine.config import TOKENIZER_TYPES, ConfigError
from engine.data.tokenizer_export import save_for_transformers, sentencepiece_as_bpe, special_ids

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SENTENCEPIECE, GPT2BPE, HUGGINGFACE, NULL = TOKENIZER_TYPES
# End-of-document candidates of a bare tokenizer.json (no tokenizer_config.json beside it names its eos token).
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>")


class Tokenizer:
    """A SentencePiece model: `encode(text) -> list[int]`, `decode(ids) -> str`; `.vocab_size`, `.eod`, `.bos`,
    `.pad` (the model's eos piece ends a document)."""

    kind = SENTENCEPIECE

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"{model_path} not found; train one with tools/train_tokenizer.py")
        self.model_path = model_path
        self.source = f"--tokenizer-model {model_path}"
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos = self.sp.bos_id()
        self.eod = self.sp.eos_id()
        self.pad = self.sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from worker processes, and a fair per-worker figure needs it.
        return self.sp.encode(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save_pretrained(self, out_dir: str) -> dict:
        """The model as a tokenizer.json (byte-fallback BPE of the `tokenizers` library) that encodes like it."""
        sp = self.sp
        piece = sp.id_to_piece
        specials = [piece(i) for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)]
        names = {k: piece(i) if 0 <= i < self.vocab_size else None
                 for k, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("pad_token", sp.pad_id()),
                              ("unk_token", sp.unk_id()))}
        tk = sentencepiece_as_bpe(self)
        # SentencePiece reads "</s>" in text as characters: so must the export (split_special_tokens).
        return save_for_transformers(tk, out_dir, names, specials, split_special_tokens=True)


class _Backed:
    """A `tokenizers.Tokenizer` (`self.tk`) behind the engine's interface."""

    kind, source = "", ""
    bos = eod = pad = None

    def _sizes(self) -> None:
        vocab = self.tk.get_vocab(with_added_tokens=True)
        self.vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch_fast(texts)]

    def decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_Backed):
    """GPT-2's byte-level BPE from vocab.json and merges.txt. As Megatron-LM's, the text "<|endoftext|>" is
    encoded as characters; the id of that token (`.eod`) only ends documents."""

    kind = GPT2BPE

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        self.source = f"--vocab-file {vocab_file} --merge-file {merge_file}"
        try:
            with open(vocab_file, encoding="utf-8") as fh:
                vocab = json.load(fh)
            if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (a JSON object of token: id); give "
                              "the vocab.json the data was made with") from None
        if "<|endoftext|>" not in vocab:
            raise ConfigError(f"--vocab-file {vocab_file}: has no <|endoftext|> token, which {GPT2BPE} ends "
                              "documents with; give GPT-2's vocab.json (or use --tokenizer-type HuggingFaceTokenizer)")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the tokenizers library raises a bare Exception naming the bad line
            raise ConfigError(f"--merge-file {merge_file}: not a GPT-2 merges.txt for --vocab-file {vocab_file} "
                              f"({str(e).splitlines()[0][:80]}); give the merges.txt that goes with it") from None
        self.tk = HFTokenizer(model)
        self.tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tk.decoder = decoders.ByteLevel()
        self.eod = self.bos = vocab["<|endoftext|>"]
        self._sizes()

    def save_pretrained(self, out_dir: str) -> dict:
        eot = "<|endoftext|>"
        ids = save_for_transformers(self.tk, out_dir, {"bos_token": eot, "eos_token": eot},
                                     split_special_tokens=True)
        self.tk.model.save(out_dir)  # vocab.json and merges.txt as well, for Megatron-LM's --vocab-file/--merge-file
        return ids


class HuggingFaceTokenizer(_Backed):
    """A transformers tokenizer directory, through AutoTokenizer as Megatron-LM loads it (special tokens added
    as it adds them, e.g. a BOS), or a bare tokenizer.json through the `tokenizers` library (its post-processor
    adds them; the eos token is the one a tokenizer_config.json beside it names, else a usual name)."""

    kind = HUGGINGFACE

    def __init__(self, path: str):
        self.path, self.source = path, f"--tokenizer-model {path}"
        self.hf = self.tk = None
        if os.path.isdir(path):
            self._load_directory(path)
        else:
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self.tk = HFTokenizer.from_file(path)
            except Exception as e:
                raise ConfigError(f"--tokenizer-model {path}: not a tokenizer.json the tokenizers library reads "
                                  f"({str(e).splitlines()[0][:80]})") from None
            self.names = _bare_special_tokens(self.tk, os.path.dirname(os.path.abspath(path)))
            ids = {k: self.tk.token_to_id(v) if v else None for k, v in self.names.items()}
            self.bos, self.eod, self.pad = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        self._sizes()

    def _load_directory(self, path: str) -> None:
        from transformers import AutoTokenizer
        try:
            self.hf = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ConfigError(f"--tokenizer-model {path}: transformers cannot load a tokenizer from it "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})") from None
        self.bos, self.eod, self.pad = self.hf.bos_token_id, self.hf.eos_token_id, self.hf.pad_token_id
        # A fast tokenizer's __call__ is its Rust tokenizer's encode_batch (special tokens added, and read in text
        # unless split_special_tokens): called directly, without the Python per-call overhead.
        self.tk = getattr(self.hf, "backend_tokenizer", None)
        if self.tk is not None:
            self.tk.encode_special_tokens = bool(getattr(self.hf, "split_special_tokens", False))

    def _sizes(self) -> None:
        if self.hf is None:
            return super()._sizes()
        self.vocab_size = max(len(self.hf), max(self.hf.get_vocab().values(), default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        return super().encode(text) if self.tk is not None else self.hf(text)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.tk is not None:
            return super().encode_batch(texts)
        return self.hf(texts)["input_ids"] if texts else []

    def decode(self, ids) -> str:
        if self.hf is None:
            return super().decode(ids)
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_pretrained(self, out_dir: str) -> dict:
        if self.hf is None:
            return save_for_transformers(self.tk, out_dir, self.names)
        os.makedirs(out_dir, exist_ok=True)
        self.hf.save_pretrained(out_dir)
        return special_ids(self.hf)


def _bare_special_tokens(tk, directory: str) -> dict:
    """{bos,eos,pad,unk}_token of a bare tokenizer.json: from a tokenizer_config.json beside it, else its special
    tokens by usual names."""
    names = {"bos_token": None, "eos_token": None, "pad_token": None, "unk_token": None}
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        for key in names:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            names[key] = value if isinstance(value, str) and tk.token_to_id(value) is not None else None
    except (OSError, ValueError, AttributeError):
        pass
    specials = {t.content for t in tk.get_added_tokens_decoder().values() if t.special}
    if names["eos_token"] is None:
        names["eos_token"] = next((t for t in EOD_NAMES if t in specials), None)
    if names["bos_token"] is None:
        names["bos_token"] = next((t for t in ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
                                   if t in specials), None)
    if names["unk_token"] is None and "<unk>" in specials:
        names["unk_token"] = "<unk>"
    return names


class NullTokenizer:
    """Megatron-LM's NullTokenizer: text is whitespace-separated integer ids; ids below `vocab_size` (--vocab-size
    N) are text and N ends a document, so the vocabulary holds N + 1 ids. Text with anything else is refused
    (ValueError: preprocessing drops the document and counts it)."""

    kind = NULL

    def __init__(self, vocab_size: int):
        self.text_vocab = int(vocab_size)
        self.vocab_size = self.text_vocab + 1
        self.eod = self.bos = self.text_vocab
        self.pad = None
        self.source = f"--tokenizer-type {NULL} --vocab-size {self.text_vocab}"

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            ids = [-1]
        if ids and not 0 <= min(ids) <= max(ids) <= self.text_vocab:
            raise ValueError(f"not whitespace-separated integer ids from 0 to {self.text_vocab} ({NULL})")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_pretrained(self, out_dir: str) -> dict:
        """A word-level tokenizer.json whose words are the ids themselves."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers
        # No unknown word: text other than ids is an error there too, not a silent id.
        tk = HFTokenizer(models.WordLevel({str(i): i for i in range(self.vocab_size)}, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        eod = str(self.eod)
        return save_for_transformers(tk, out_dir, {"bos_token": eod, "eos_token": eod}, split_special_tokens=True)

"""Tokenizers: training a SentencePiece BPE model, and the wrappers the engine encodes and decodes with.

Training settings follow what makes a tokenizer lossless for pretraining: byte fallback (no unknown
text), digits split one per token, no text normalisation and no whitespace collapsing (so source code
round-trips), and fixed ids for the special tokens: unk 0, bos 1, eos (= end of document) 2, pad 3.
Training lives in tokenizer_training.py (with progress bars with an ETA: the input read, then the merges).

Tokenizers users bring, by `--tokenizer-type` with Megatron-LM's meaning (`tokenizer_spec` checks the
flags, `TokenizerSpec.build` opens the files; both say what is wrong in one ConfigError line):
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
and that encode text to the same ids.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import sentencepiece as spm

from engine.config import TOKENIZER_TYPES, ConfigError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SENTENCEPIECE, GPT2BPE, HUGGINGFACE, NULL = TOKENIZER_TYPES


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
        tk = _sentencepiece_as_bpe(self)
        # SentencePiece reads "</s>" in text as characters: so must the export (split_special_tokens).
        return _save_for_transformers(tk, out_dir, names, specials, split_special_tokens=True)


def _sentencepiece_as_bpe(tok: Tokenizer):
    """The same BPE in the `tokenizers` library: SentencePiece merges the adjacent pair whose union scores
    highest, so every split of a piece into two pieces becomes a merge ranked by the union's score. Its text
    handling (spaces as "▁", one "▁" in front) becomes the normalizer. Checked on a probe text: a model whose
    normalisation differs (e.g. NFKC, whitespace collapsing) is refused rather than exported inexactly."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    sp, n = tok.sp, tok.vocab_size
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    normal = {sp.id_to_piece(i): i for i in range(n)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}
    merges = []
    for p, i in normal.items():
        for k in range(1, len(p)):
            if p[:k] in normal and p[k:] in normal:
                merges.append((-sp.get_score(i), normal[p[:k]], normal[p[k:]], p[:k], p[k:]))
    merges.sort()
    byte_fallback = any(sp.is_byte(i) for i in range(n))
    model = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=sp.id_to_piece(sp.unk_id()),
                       byte_fallback=byte_fallback, fuse_unk=True)
    tk = HFTokenizer(model)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                           for i in range(n) if sp.is_control(i) or sp.is_unknown(i)])
    tk.encode_special_tokens = True
    probe = ("def f(x):\n    return  x + 12345  # naïve café ☃ 漢字\n\n\tend \u00a0 ﬁ Ａ </s> <s> "
             + " ".join(p.replace("▁", " ") for p in list(normal)[:200]))
    if sp.encode(probe) != tk.encode(probe, add_special_tokens=False).ids:
        raise ConfigError(f"--tokenizer-model {tok.model_path}: this SentencePiece model cannot be written as an "
                          "exactly equivalent tokenizer.json (it is not a BPE model with identity normalisation); "
                          "export with --format native")
    return tk


def _save_for_transformers(tk, out_dir: str, names: dict, specials=(), split_special_tokens: bool = False,
                           extra: Optional[dict] = None) -> dict:
    """Write `tk` (a `tokenizers.Tokenizer`) with its special tokens as transformers saves a fast tokenizer;
    returns the config ids {bos,eos,pad}_token_id (pad falls back to eos: generate() needs one)."""
    from transformers import PreTrainedTokenizerFast
    kwargs = {k: v for k, v in names.items() if v is not None}
    others = [s for s in specials if s not in kwargs.values()]
    if others:
        kwargs["additional_special_tokens"] = others
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, split_special_tokens=split_special_tokens,
                                 clean_up_tokenization_spaces=False, **kwargs, **(extra or {}))
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return _special_ids(hf)


def _special_ids(hf) -> dict:
    eos = hf.eos_token_id
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos
    return {"bos_token_id": hf.bos_token_id, "eos_token_id": eos, "pad_token_id": pad}


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers users bring: --tokenizer-type with Megatron-LM's companions.

HF_DIRECTORY_FILES = ("tokenizer.json", "tokenizer_config.json")
# End-of-document candidates of a bare tokenizer.json (no tokenizer_config.json beside it names its eos token).
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>")


def infer_tokenizer_type(tokenizer_model: Optional[str], vocab_file: Optional[str] = None,
                         merge_file: Optional[str] = None) -> Optional[str]:
    """The --tokenizer-type the files imply when none is given: GPT-2 files, a tokenizer.json or directory (Hugging
    Face), else a SentencePiece model (the default, as before the flag existed); None without any tokenizer file."""
    if vocab_file or merge_file:
        return GPT2BPE
    if not tokenizer_model:
        return None
    if os.path.isdir(tokenizer_model) or tokenizer_model.endswith(".json"):
        return HUGGINGFACE
    return SENTENCEPIECE


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer is made from, as the flags name it. Picklable: preprocessing workers rebuild from it."""
    type: str
    model: Optional[str] = None       # --tokenizer-model
    vocab_file: Optional[str] = None  # --vocab-file
    merge_file: Optional[str] = None  # --merge-file
    null_vocab: Optional[int] = None  # NullTokenizer: --vocab-size (ids below it are text, it is the EOD id)

    @property
    def source(self) -> str:
        """The flags, for messages."""
        if self.type == GPT2BPE:
            return f"--vocab-file {self.vocab_file} --merge-file {self.merge_file}"
        if self.type == NULL:
            return f"--tokenizer-type {NULL} --vocab-size {self.null_vocab}"
        return f"--tokenizer-model {self.model}"

    def vocab_size(self) -> int:
        """The ids the model needs (a NullTokenizer's without opening anything)."""
        return self.null_vocab + 1 if self.type == NULL else self.build().vocab_size

    def build(self):
        """Open the files; a file that is not what the type needs is one ConfigError line."""
        if self.type == SENTENCEPIECE:
            try:
                return Tokenizer(self.model)
            except (OSError, RuntimeError):
                hint = ("; it looks like a Hugging Face tokenizer: use --tokenizer-type HuggingFaceTokenizer"
                        if self.model.endswith(".json") else "; train one with tools/train_tokenizer.py")
                raise ConfigError(f"--tokenizer-model {self.model}: not a SentencePiece model{hint}") from None
        if self.type == GPT2BPE:
            return GPT2BPETokenizer(self.vocab_file, self.merge_file)
        if self.type == HUGGINGFACE:
            return HuggingFaceTokenizer(self.model)
        return NullTokenizer(self.null_vocab)


def tokenizer_spec(tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                   vocab_size: Optional[int] = None) -> Optional[TokenizerSpec]:
    """The flags as a TokenizerSpec (None when they name no tokenizer), or one ConfigError line for a combination
    that cannot work or a file that is missing. Opens nothing (see TokenizerSpec.build); `vocab_size` is
    --vocab-size, which only NullTokenizer reads."""
    kind = tokenizer_type or infer_tokenizer_type(tokenizer_model, vocab_file, merge_file)
    if kind is None:
        return None
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {kind}: use one of {', '.join(TOKENIZER_TYPES)}")
    if kind != GPT2BPE and (vocab_file or merge_file):
        flag, value = ("--vocab-file", vocab_file) if vocab_file else ("--merge-file", merge_file)
        raise ConfigError(f"{flag} {value}: only --tokenizer-type {GPT2BPE} reads it (this run: {kind}); drop "
                          f"{flag} or use --tokenizer-type {GPT2BPE}")
    if kind in (GPT2BPE, NULL) and tokenizer_model:
        reads = "--vocab-file and --merge-file" if kind == GPT2BPE else "whitespace-separated integer ids"
        raise ConfigError(f"--tokenizer-model {tokenizer_model}: {kind} reads {reads}, not a tokenizer model; drop "
                          "--tokenizer-model or choose another --tokenizer-type")
    if kind == GPT2BPE:
        missing = [f for f, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if not v]
        if missing:
            raise ConfigError(f"--tokenizer-type {GPT2BPE}: needs --vocab-file (GPT-2's vocab.json) and --merge-file "
                              f"(its merges.txt); add {' and '.join(missing)}")
        for flag, path, what in (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file,
                                                                           "merges.txt")):
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: file not found; give the GPT-2 {what} the data was made with")
        return TokenizerSpec(kind, vocab_file=vocab_file, merge_file=merge_file)
    if kind == NULL:
        if not vocab_size:
            raise ConfigError(f"--tokenizer-type {NULL}: needs --vocab-size N (text ids 0..N-1; N ends a document, "
                              "as in Megatron-LM)")
        return TokenizerSpec(kind, null_vocab=int(vocab_size))
    if not tokenizer_model:
        what = "FILE.model" if kind == SENTENCEPIECE else "(a tokenizer.json or a transformers tokenizer directory)"
        raise ConfigError(f"--tokenizer-type {kind}: needs --tokenizer-model {what}")
    if kind == SENTENCEPIECE:
        if os.path.isdir(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: a directory, not a SentencePiece .model file; use "
                              f"--tokenizer-type {HUGGINGFACE} for a transformers tokenizer directory")
        if not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: file not found; train one with "
                              "tools/train_tokenizer.py")
    else:
        if not os.path.exists(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: file or directory not found; give a tokenizer.json "
                              "or the directory a transformers tokenizer was saved to")
        if os.path.isfile(tokenizer_model) and _is_sentencepiece(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: a SentencePiece model, not a tokenizer.json or "
                              f"transformers tokenizer directory; use --tokenizer-type {SENTENCEPIECE}")
        if os.path.isdir(tokenizer_model) and not any(os.path.isfile(os.path.join(tokenizer_model, f))
                                                      for f in HF_DIRECTORY_FILES):
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: holds no {' or '.join(HF_DIRECTORY_FILES)}; give "
                              "the directory a transformers tokenizer was saved to (save_pretrained)")
    return TokenizerSpec(kind, model=tokenizer_model)


def _is_sentencepiece(path: str) -> bool:
    if path.endswith(".json"):
        return False
    try:
        spm.SentencePieceProcessor(model_file=path)
        return True
    except (OSError, RuntimeError):
        return False


def run_tokenizer_spec(data: dict, vocab_size: int, near: Iterable[str] = (), **given) -> Optional[TokenizerSpec]:
    """The tokenizer a run trained with, from the data section of its saved config, for tools that read its
    checkpoint. `vocab_size` is the model's (a NullTokenizer's end of document is its last id). `given` holds flags
    of the tool (tokenizer_type, tokenizer_model, vocab_file, merge_file) that replace the saved ones (a
    different --tokenizer-type replaces them all); a saved path that is gone is looked for by name in `near`."""
    names = ("tokenizer_model", "vocab_file", "merge_file")
    given = {k: v for k, v in given.items() if v is not None}
    saved_type = data.get("tokenizer_type") or infer_tokenizer_type(*(data.get(k) for k in names))
    kind = given.get("tokenizer_type") or infer_tokenizer_type(*(given.get(k) for k in names)) or saved_type
    flags = {k: given.get(k, data.get(k) if kind == saved_type else None) for k in names}
    for k in names:
        path = flags[k]
        if k not in given and path and not os.path.exists(path):
            found = [os.path.join(d, os.path.basename(path.rstrip("/"))) for d in near]
            flags[k] = next((f for f in found if os.path.exists(f)), path)
    return tokenizer_spec(kind, **flags, vocab_size=vocab_size - 1 if kind == NULL else None)


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
        ids = _save_for_transformers(self.tk, out_dir, {"bos_token": eot, "eos_token": eot},
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
            return _save_for_transformers(self.tk, out_dir, self.names)
        os.makedirs(out_dir, exist_ok=True)
        self.hf.save_pretrained(out_dir)
        return _special_ids(self.hf)


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
        return _save_for_transformers(tk, out_dir, {"bos_token": eod, "eos_token": eod}, split_special_tokens=True)

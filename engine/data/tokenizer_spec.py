"""Which files a `--tokenizer-type` needs, checked before anything is opened, and the vocabulary a run takes from them.

`tokenizer_spec` turns the flags into a `TokenizerSpec` or one ConfigError line (a combination that cannot work, a
file that is missing); `TokenizerSpec.build` opens the files. `TYPES` is the one registry: each --tokenizer-type
(engine.config.TOKENIZER_TYPES, Megatron-LM's names) maps to the check of its flags and the class in
engine/data/tokenizer.py that opens it, so a new type is a class there and an entry here.

The run's vocabulary (`data_vocab_size`, `vocab_source`) is the tokenizer's when one reads real data: it is read
here, below engine/resolve.py, so that engine/config/ stays a description that opens no file.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import sentencepiece as spm

from engine.config import TOKENIZER_TYPES, Config, ConfigError
from engine.data.tokenizer import (
    GPT2BPE,
    HUGGINGFACE,
    NULL,
    SENTENCEPIECE,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
)

DEFAULT_VOCAB_SIZE = 256  # --mock-data without --vocab-size
HF_DIRECTORY_FILES = ("tokenizer.json", "tokenizer_config.json")


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
        if self.vocab_file:
            return f"--vocab-file {self.vocab_file} --merge-file {self.merge_file}"
        if self.null_vocab is not None:
            return f"--tokenizer-type {self.type} --vocab-size {self.null_vocab}"
        return f"--tokenizer-model {self.model}"

    def vocab_size(self) -> int:
        """The ids the model needs (a NullTokenizer's without opening anything)."""
        return self.null_vocab + 1 if self.null_vocab is not None else self.build().vocab_size

    def build(self):
        """Open the files; a file that is not what the type needs is one ConfigError line."""
        return TYPES[self.type].open(self)


@dataclass(frozen=True)
class TokenizerType:
    """One --tokenizer-type: `spec(tokenizer_model, vocab_file, merge_file, vocab_size)` checks its flags into a
    TokenizerSpec, `open(spec)` builds the tokenizer, `reads` says what it reads when not a --tokenizer-model."""
    spec: Callable[..., TokenizerSpec]
    open: Callable[[TokenizerSpec], object]
    reads: Optional[str] = None


def _open_sentencepiece(spec: TokenizerSpec) -> Tokenizer:
    try:
        return Tokenizer(spec.model)
    except (OSError, RuntimeError):
        hint = ("; it looks like a Hugging Face tokenizer: use --tokenizer-type HuggingFaceTokenizer"
                if spec.model.endswith(".json") else "; train one with tools/train_tokenizer.py")
        raise ConfigError(f"--tokenizer-model {spec.model}: not a SentencePiece model{hint}") from None


def _needs_model(kind: str, tokenizer_model: Optional[str], what: str) -> None:
    if not tokenizer_model:
        raise ConfigError(f"--tokenizer-type {kind}: needs --tokenizer-model {what}")


def _sentencepiece_spec(tokenizer_model, vocab_file, merge_file, vocab_size) -> TokenizerSpec:
    _needs_model(SENTENCEPIECE, tokenizer_model, "FILE.model")
    if os.path.isdir(tokenizer_model):
        raise ConfigError(f"--tokenizer-model {tokenizer_model}: a directory, not a SentencePiece .model file; use "
                          f"--tokenizer-type {HUGGINGFACE} for a transformers tokenizer directory")
    if not os.path.isfile(tokenizer_model):
        raise ConfigError(f"--tokenizer-model {tokenizer_model}: file not found; train one with "
                          "tools/train_tokenizer.py")
    return TokenizerSpec(SENTENCEPIECE, model=tokenizer_model)


def _huggingface_spec(tokenizer_model, vocab_file, merge_file, vocab_size) -> TokenizerSpec:
    _needs_model(HUGGINGFACE, tokenizer_model, "(a tokenizer.json or a transformers tokenizer directory)")
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
    return TokenizerSpec(HUGGINGFACE, model=tokenizer_model)


def _gpt2_spec(tokenizer_model, vocab_file, merge_file, vocab_size) -> TokenizerSpec:
    missing = [f for f, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if not v]
    if missing:
        raise ConfigError(f"--tokenizer-type {GPT2BPE}: needs --vocab-file (GPT-2's vocab.json) and --merge-file "
                          f"(its merges.txt); add {' and '.join(missing)}")
    for flag, path, what in (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file, "merges.txt")):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: file not found; give the GPT-2 {what} the data was made with")
    return TokenizerSpec(GPT2BPE, vocab_file=vocab_file, merge_file=merge_file)


def _null_spec(tokenizer_model, vocab_file, merge_file, vocab_size) -> TokenizerSpec:
    if not vocab_size:
        raise ConfigError(f"--tokenizer-type {NULL}: needs --vocab-size N (text ids 0..N-1; N ends a document, "
                          "as in Megatron-LM)")
    return TokenizerSpec(NULL, null_vocab=int(vocab_size))


TYPES = {
    SENTENCEPIECE: TokenizerType(_sentencepiece_spec, _open_sentencepiece),
    GPT2BPE: TokenizerType(_gpt2_spec, lambda s: GPT2BPETokenizer(s.vocab_file, s.merge_file),
                           reads="--vocab-file and --merge-file"),
    HUGGINGFACE: TokenizerType(_huggingface_spec, lambda s: HuggingFaceTokenizer(s.model)),
    NULL: TokenizerType(_null_spec, lambda s: NullTokenizer(s.null_vocab), reads="whitespace-separated integer ids"),
}


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


def tokenizer_spec(tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                   vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                   vocab_size: Optional[int] = None) -> Optional[TokenizerSpec]:
    """The flags as a TokenizerSpec (None when they name no tokenizer), or one ConfigError line for a combination
    that cannot work or a file that is missing. Opens nothing (see TokenizerSpec.build); `vocab_size` is
    --vocab-size, which only NullTokenizer reads."""
    kind = tokenizer_type or infer_tokenizer_type(tokenizer_model, vocab_file, merge_file)
    if kind is None:
        return None
    if kind not in TYPES:
        raise ConfigError(f"--tokenizer-type {kind}: use one of {', '.join(TOKENIZER_TYPES)}")
    if kind != GPT2BPE and (vocab_file or merge_file):
        flag, value = ("--vocab-file", vocab_file) if vocab_file else ("--merge-file", merge_file)
        raise ConfigError(f"{flag} {value}: only --tokenizer-type {GPT2BPE} reads it (this run: {kind}); drop "
                          f"{flag} or use --tokenizer-type {GPT2BPE}")
    reads = TYPES[kind].reads
    if reads and tokenizer_model:
        raise ConfigError(f"--tokenizer-model {tokenizer_model}: {kind} reads {reads}, not a tokenizer model; drop "
                          "--tokenizer-model or choose another --tokenizer-type")
    return TYPES[kind].spec(tokenizer_model, vocab_file, merge_file, vocab_size)


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


def tokenizer_of(cfg: Config) -> Optional[TokenizerSpec]:
    """The run's tokenizer flags as a TokenizerSpec (None when they name none); a combination that cannot work,
    or a missing file, is one ConfigError line. Opens no file."""
    d = cfg.data
    if not (d.tokenizer_type or d.tokenizer_model or d.vocab_file or d.merge_file):
        return None
    given = cfg.given_vocab_size if cfg.given_vocab_size is not None else cfg.model.vocab_size
    return tokenizer_spec(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, given)


def data_vocab_size(cfg: Config) -> int:
    """The vocabulary a run trains with: the tokenizer's when one reads real data (a NullTokenizer's: --vocab-size
    plus its end-of-document id, as in Megatron-LM), else --vocab-size, else 256."""
    spec = None if cfg.data.mock_data else tokenizer_of(cfg)
    if spec is not None:
        return _tokenizer_vocab(spec, _mtimes(spec))  # a file that is not what the type needs: one ConfigError line
    return cfg.model.vocab_size or DEFAULT_VOCAB_SIZE


def _mtimes(spec: TokenizerSpec) -> tuple:
    paths = (spec.model, spec.vocab_file, spec.merge_file)
    return tuple(os.path.getmtime(p) if p and os.path.exists(p) else None for p in paths)


@functools.lru_cache(maxsize=8)
def _tokenizer_vocab(spec: TokenizerSpec, mtimes: tuple) -> int:
    """Opened once per process for validate and each resolve (a transformers tokenizer takes seconds to load)."""
    return spec.vocab_size()


def vocab_source(cfg: Config) -> str:
    """Which flag set the vocabulary size, for messages about token ids."""
    d, vocab = cfg.data, cfg.model.vocab_size
    spec = None if d.mock_data else tokenizer_of(cfg)
    if spec is not None:
        return spec.source + (f" and its end-of-document id {spec.null_vocab}" if spec.null_vocab is not None else "")
    if vocab is None:
        return f"{DEFAULT_VOCAB_SIZE}, the default without --tokenizer-model or --vocab-size"
    return f"--vocab-size {vocab}"

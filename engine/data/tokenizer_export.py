"""Tokenizers written as transformers saves them, so that `AutoTokenizer.from_pretrained(dir)` encodes like the
engine's wrapper: each wrapper's `save_pretrained` (engine.data.tokenizer) writes through these.

A SentencePiece model has no tokenizer.json of its own: `sentencepiece_as_bpe` rebuilds it as the same BPE in the
`tokenizers` library and refuses a model it cannot rebuild exactly.
"""
from __future__ import annotations

import os
from typing import Optional

from engine.config import ConfigError


def sentencepiece_as_bpe(tok):
    """The SentencePiece `tok` (engine.data.tokenizer.Tokenizer) as the same BPE in the `tokenizers` library:
    SentencePiece merges the adjacent pair whose union scores highest, so every split of a piece into two pieces
    becomes a merge ranked by the union's score. Its text handling (spaces as "▁", one "▁" in front) becomes the
    normalizer. Checked on a probe text: a model whose normalisation differs (e.g. NFKC, whitespace collapsing)
    is refused rather than exported inexactly."""
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


def save_for_transformers(tk, out_dir: str, names: dict, specials=(), split_special_tokens: bool = False,
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
    return special_ids(hf)


def special_ids(hf) -> dict:
    eos = hf.eos_token_id
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos
    return {"bos_token_id": hf.bos_token_id, "eos_token_id": eos, "pad_token_id": pad}

"""config.json in both directions, through the family's Rules: written from our ModelConfig (export), read into
a run Config (import), where a key Ternion cannot express is one ConfigError line.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from engine.checkpoint.hf.families import FAMILIES, import_family, imported_types
from engine.config import Config, ConfigError

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
DEFAULT_SEQ_LENGTH = 4096  # the imported run's --seq-length unless given (capped by the model's positions)


def hf_config(arch: str, cfg: Config) -> dict:
    """config.json of the export: every rule's value. The special token ids are unknown (None) until the
    tokenizer names them (export_tokenizer): never transformers' GPT-2 default 50256 outside the vocabulary."""
    a, m = FAMILIES[arch], cfg.model
    config = {"architectures": [a.name], "model_type": a.model_type}
    return config | {rule.key: rule.out(m) for rule in a.rules} | dict.fromkeys(SPECIAL_IDS)


def model_fields(hf: dict) -> tuple:
    """(FAMILIES key, ModelConfig fields) of a transformers config.json; ConfigError where Ternion differs."""
    kind = import_family(hf.get("model_type"))
    if kind is None:
        raise ConfigError(f"config.json model_type {hf.get('model_type')!r}: Ternion imports "
                          f"{', '.join(imported_types())}")
    arch = FAMILIES[kind]
    values = arch.prepare({**arch.defaults, **{k: v for k, v in hf.items() if v is not None or k not in arch.defaults}})
    fields, set_by = dict(arch.shape), {}
    for rule in (r for r in arch.rules if r.key in values):
        for field, value in rule.into(values[rule.key]).items():
            if field in set_by and fields[field] != value:
                raise ConfigError(f"config.json {rule.key} {values[rule.key]!r} and {set_by[field]} "
                                  f"{values[set_by[field]]!r}: Ternion has one setting for both "
                                  f"(--{field.replace('_', '-')})")
            fields[field], set_by[field] = value, rule.key
    for name in ("hidden_dropout", "attention_dropout"):  # none where config.json names none (not Megatron's 0.1)
        fields.setdefault(name, 0.0)
    return kind, fields


def imported_config(hf: dict, seq_length: Optional[int] = None) -> tuple:
    """(FAMILIES key, run Config, the ModelConfig fields set) of a transformers config.json, at `seq_length`
    (default: the model's positions, at most DEFAULT_SEQ_LENGTH)."""
    arch, fields = model_fields(hf)
    cfg = Config()
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    m = cfg.model
    experts_key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    if m.num_experts and not 1 <= (m.moe_router_topk or 0) <= m.num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok {m.moe_router_topk} must be between 1 and "
                          f"{experts_key} {m.num_experts}; fix the transformers config")
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length {seq_length}: must be at least 1")
    m.seq_length = seq_length or min(n for n in (m.max_position_embeddings, DEFAULT_SEQ_LENGTH) if n)
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length}: the model has {m.max_position_embeddings} learned positions "
                          "(n_positions); use at most that")
    return arch, cfg, [f.name for f in dataclasses.fields(m) if f.name in fields or f.name == "seq_length"]

"""Export (tools/merge_ckpt.py --format hf): a checkpoint as a folder `from_pretrained` loads: config.json,
model.safetensors written one tensor at a time through the family's plan, and the run's tokenizer.
"""
from __future__ import annotations

import json
import os

from engine.checkpoint import files
from engine.checkpoint.hf.config_json import SPECIAL_IDS, hf_config
from engine.checkpoint.hf.families import FAMILIES, export_family
from engine.checkpoint.hf.io import WEIGHTS
from engine.checkpoint.merged import full_unpadded, unpadded
from engine.checkpoint.reader import CheckpointReader
from engine.config import Config, ConfigError
from engine.data.tokenizer_spec import run_tokenizer_spec


def export_tokenizer(cfg: Config, ckpt_dir: str, out_dir: str) -> dict:
    """Write the run's tokenizer (any --tokenizer-type, found as saved in its config or by name beside the
    checkpoint) so that AutoTokenizer.from_pretrained(out_dir) encodes text to the ids it trained on; return its
    bos/eos/pad ids for config.json ({} when the run had none, e.g. mock data). `cfg.model.vocab_size` is the
    checkpoint's. A tokenizer that is gone or does not fit the model is one ConfigError line."""
    vocab, near = cfg.model.vocab_size, [ckpt_dir, os.path.dirname(os.path.abspath(ckpt_dir))]
    try:
        spec = run_tokenizer_spec(cfg.to_dict()["data"], vocab, near=near)
        tok = spec.build() if spec is not None else None
    except ConfigError as e:
        raise ConfigError(f"--format hf: the run's tokenizer cannot be exported: {e} (also looked for beside "
                          f"{near[1]}); put it back, or use --format native") from None
    if tok is None:
        return {}
    if tok.vocab_size > vocab:
        raise ConfigError(f"--format hf: the run's tokenizer ({tok.source}) has {tok.vocab_size} ids but the model "
                          f"{vocab}; it is not the tokenizer the model was trained with")
    return tok.save_pretrained(out_dir)


def export_hf(reader: CheckpointReader, out_dir: str) -> str:
    """Write config.json and model.safetensors for transformers; return the architecture (FAMILIES key)."""
    cfg = Config.from_dict(reader.meta.config)
    cfg.model.vocab_size = reader.meta.vocab_size or cfg.model.vocab_size
    arch = export_family(cfg.model)
    plan, config = FAMILIES[arch].plan(cfg.model), hf_config(arch, cfg)
    missing = [src for _, src, _ in plan if src not in reader.tensors]
    if missing:
        raise ConfigError(f"checkpoint {reader.path} has no tensor {missing[0]}; it does not look like a {arch} model")
    specs = []
    for dst, src, how in plan:
        shape, dtype = unpadded(reader, src)
        specs.append((dst, dtype, how.out_shape(shape)))
    config["torch_dtype"] = config["dtype"] = str(specs[0][1]).removeprefix("torch.")  # old and new key names
    config.update(export_tokenizer(cfg, reader.path, out_dir))

    def tensors():
        current, full = None, None  # q, k and v come from one fused tensor: read it once
        for dst, src, how in plan:
            if current != src:
                full = None  # drop the previous tensor before reading the next
                current, full = src, full_unpadded(reader, src)
            yield dst, how.out(full).contiguous()

    os.makedirs(out_dir, exist_ok=True)
    files.write_safetensors(os.path.join(out_dir, WEIGHTS), specs, tensors(), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:  # what generate() stops and pads with
        json.dump({k: v for k, v in config.items() if k in SPECIAL_IDS and v is not None}, fh, indent=1)
    return arch

"""Hugging Face `transformers` model folders in and out, one tensor at a time, one adapter per family.

Export (`export_hf`, tools/merge_ckpt.py --format hf) writes a checkpoint as a folder `from_pretrained`
loads; import (`import_hf`, tools/convert_hf.py) writes such a folder (safetensors, sharded or not) as
iteration 0 of a checkpoint directory, which loads at any layout. Each family is one module (llama, mistral,
qwen2, gpt2, mixtral, qwen2_moe) defining an `Adapter` (adapter.py): its config.json `Rule`s, each key with both
directions, and its plan, (HF name, our name, Transform) for every tensor, where the `Transform`
(transforms.py) maps the tensor one way (`out`) and back (`into`). families.py registers them; export and
import (to_hf.py, from_hf.py, config_json.py) read only the adapter, so each fact is written down once.
"""
from engine.checkpoint.hf.config_json import hf_config, imported_config, model_fields
from engine.checkpoint.hf.families import ARCHITECTURES, FAMILIES, MOE_ARCHITECTURES
from engine.checkpoint.hf.from_hf import import_hf
from engine.checkpoint.hf.to_hf import export_hf, export_tokenizer

__all__ = ["import_hf", "export_hf", "export_tokenizer", "hf_config", "imported_config", "model_fields",
           "ARCHITECTURES", "MOE_ARCHITECTURES", "FAMILIES"]

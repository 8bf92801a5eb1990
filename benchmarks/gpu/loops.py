"""The training loops the check times against each other, behind one interface: step(i) -> loss, layers().

- engine: Ternion's own iteration, engine.training.Trainer.iterate (what pretrain_gpt.py runs per step);
- plain: benchmarks/train.py's PlainLoop, the same GPTModel trained the textbook way (fp32 weights, bf16
  autocast, fused torch AdamW);
- transformers: the same architecture as transformers builds it (LlamaForCausalLM / GPT2LMHeadModel,
  attn_implementation="sdpa"), fp32 weights under bf16 autocast, fused torch AdamW, loss as transformers
  computes it (logits upcast to fp32, then cross-entropy). It starts from the plain loop's weights, mapped by
  the HF export's own tensor plan (engine/checkpoint/hf), so all three train one model on one batch stream
  and their losses can be compared.

torch.compile is applied per transformer layer (`compile_layers`: the "regional" recipe, one compilation
reused by every layer), which keeps the cold start to tens of seconds; embedding, head and loss stay eager.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.train import PlainLoop


class EngineLoop:
    name = "engine"
    autocast = None  # bf16 weights (--bf16): nothing to cast
    loss = PlainLoop.loss  # one microbatch's mean loss (the gradient check's): the same model class, called alike

    def __init__(self, trainer):
        self.trainer = trainer
        self.model = trainer.chunks[0]  # one device: one chunk, the whole GPTModel

    def step(self, iteration: int) -> float:
        """One engine iteration; it consumes the same samples as the others' `iteration` (its sampler's order)."""
        self.trainer.iterate()
        return self.trainer.last_record["lm_loss"]

    def layers(self) -> list:
        return [layer for chunk in self.trainer.chunks for layer in chunk.layers.values()]


class TorchLoop(PlainLoop):
    """benchmarks/train.py's plain loop, with the layers to compile."""
    name = "plain"

    def layers(self) -> list:
        return list(self.model.layers.values())


class TransformersLoop(PlainLoop):
    name = "transformers"

    def __init__(self, cfg, ctx, trainer, device, source):
        self.source = source  # the engine-shaped fp32 model whose weights it starts from
        super().__init__(cfg, ctx, trainer, device)
        del self.source

    def build_model(self, ctx):
        from transformers import AutoConfig, AutoModelForCausalLM

        from engine.checkpoint.hf.config_json import hf_config
        from engine.checkpoint.hf.families import FAMILIES, export_family
        arch = export_family(self.cfg.model)
        config = hf_config(arch, self.cfg)
        hf_cfg = AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device(self.device):  # initialised where it trains: a 1.3B CPU init would take tens of seconds
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
        load_engine_weights(model, self.source, FAMILIES[arch].plan(self.cfg.model), self.cfg.model.vocab_size)
        return model

    def loss(self, batch):
        from engine.loss import mean_loss
        logits = self.model(input_ids=batch["tokens"]).logits
        labels = batch["labels"]
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return mean_loss(per_token.view_as(labels), batch["loss_mask"])

    def layers(self) -> list:
        inner = getattr(self.model, "model", None) or self.model.transformer
        return list(getattr(inner, "layers", None) or inner.h)


@torch.no_grad()
def load_engine_weights(model, source, plan, vocab_size: int) -> None:
    """Copy an engine GPTModel's weights into a transformers model by the export plan (HF name, our name,
    transform), the vocabulary padding dropped; anything left unset but tied or a buffer is an error."""
    ours = source.state_dict()
    theirs = {}
    for dst, src, how in plan:
        t = ours[src]
        theirs[dst] = how.out(t[:vocab_size] if t.shape[0] == source.padded_vocab else t)
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    left = set(missing) - tied
    if unexpected or left:
        raise RuntimeError(f"transformers weights from the engine: unexpected {sorted(unexpected)[:5]}, "
                           f"missing {sorted(left)[:5]}")


RECOMPILE_LIMIT = 64  # the engine's layer class serves both models and both precisions: more than dynamo's 8 guards


def compile_layers(loop, backend: str) -> None:
    """Compile each transformer layer of `loop` in place. Past dynamo's recompile limit a layer would silently
    run eager and its row would not be a compiled one, so the limit is raised first."""
    import torch._dynamo
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    for layer in loop.layers():
        layer.compile(backend=backend)

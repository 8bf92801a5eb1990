"""The README's "to add X, touch Y" recipes, each shown true: the new thing is added here the way the recipe
says (a name, a value, a registry entry, patched in for the test), and the parts of the engine the recipe does
not name take it without a change. The HF-family recipe has its own test (tests/test_hf_adapters.py: a toy
family round-trips through the tools), and tests/test_architecture.py pins that schedule and strategy names
are compared in engine/layout.py only.
"""
import dataclasses

import pytest
import torch
from test_pipeline import replay_exchanges

from engine import flops, layout
from engine.attention_mask import AttentionMask
from engine.config import Config, ModelConfig
from engine.data import tokenizer_spec
from engine.layout import SCHEDULE_KINDS, Layout, PipelineSchedule, Sharding
from engine.model import GPTModel
from engine.optim import build_optimizer
from engine.parallel.attention import LocalAttention
from engine.parallel.topology import ParallelContext
from engine.pipeline.p2p import exchange_plan
from engine.pipeline.schedules import schedule_steps, simulate
from engine.planner import memory, search
from engine.validation import validate
from harness import NO_DROPOUT


def _model(**kw) -> ModelConfig:
    return ModelConfig(**NO_DROPOUT, num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       make_vocab_size_divisible_by=16, **kw)


def test_a_new_pipeline_schedule_is_its_name_its_kind_and_its_order(monkeypatch):
    """Recipe: the name (engine/config/fields.py), its kind (engine/layout.py SCHEDULE_KINDS), and for a new
    order an order builder dispatched by engine/pipeline/schedules.schedule_steps. Here a V-shaped split-backward
    kind under a new name: placement, the exchange plan, validation, the simulator and the planner take it."""
    monkeypatch.setattr(layout, "PIPELINE_SCHEDULES", layout.PIPELINE_SCHEDULES + ("zb-v-twin",))
    monkeypatch.setitem(SCHEDULE_KINDS, "zb-v-twin", SCHEDULE_KINDS["zb-v"])
    twin = PipelineSchedule.of("zb-v-twin", 4)
    assert (twin.vpp, twin.v_shape, twin.split_backward, twin.loss_rank) == (2, True, True, 0)
    plans = [exchange_plan(schedule_steps(twin, r, 8), twin, r) for r in range(4)]
    assert replay_exchanges(plans)["sent"], "the plan replays without deadlock"
    assert simulate(twin, 32, 1.0, 1.0, 1.0)["period"] == pytest.approx(96.0)  # ZB-V's zero bubble
    cfg = Config()
    cfg.model, cfg.data.mock_data = _model(), True
    cfg.parallel.pipeline_model_parallel_size, cfg.parallel.pipeline_schedule = 4, "zb-v-twin"
    validate(cfg, 4)
    assert search.schedules_for(8, 4, 1, None, ("zb-v-twin",)) == [(2, "zb-v-twin")]
    lay = Layout(pp=4, pipeline_schedule="zb-v-twin")
    assert memory.memory_per_gpu(cfg.model, lay, 16, 8).rank == 0  # embedding and loss on rank 0


def test_a_new_sharding_strategy_is_its_name_and_what_it_shards(monkeypatch):
    """Recipe: the name (engine/config/fields.py) and what it shards (engine/layout.py Sharding); a new kind of
    group (HSDP's replicas) adds it to engine/parallel/topology.py and its use to engine/optim/. Here a strategy
    sharding what ZeRO-2 shards under a new name: the optimizer and the planner treat it as ZeRO-2."""
    monkeypatch.setattr(layout, "SHARDING_STRATEGIES", layout.SHARDING_STRATEGIES + ("zero2",))
    monkeypatch.setattr(Sharding, "grads", property(lambda s: s.strategy in ("optim_grads", "optim_grads_params",
                                                                              "zero2")))
    cfg = Config()
    cfg.model = _model()
    model = GPTModel(cfg.model, ParallelContext(), seed=1)
    by = {}
    for name in ("optim_grads", "zero2"):
        cfg.parallel.data_parallel_sharding_strategy = name
        ctx = ParallelContext.virtual(layout=Layout.from_config(cfg, 1))
        opt = build_optimizer(cfg, [model], ctx)
        by[name] = (opt.distributed, opt.buffer.shard_grads, memory.state_bytes(10_000, Layout(dp=8,
                                                                                                 sharding_strategy=name), "bf16"))
    assert by["zero2"] == by["optim_grads"]


def test_a_new_attention_variant_is_one_value_every_path_and_formula_reads(monkeypatch):
    """Recipe: the value (engine/attention_mask.py: a field, how `of` reads its flag, `counted_pairs`), the flag
    (engine/config/model.py), the kernels' masks (kernels/) and the CP ring's block plan
    (engine/parallel/ring_attention.py). The model hands the value to its one attention entry point, and the
    FLOP and memory formulas count what it says."""
    seen = []
    monkeypatch.setattr(LocalAttention, "__call__", lambda self, q, k, v, mask, p=0.0, scale=None: seen.append(mask) or q)
    model = GPTModel(_model(position_embedding_type="rope"), ParallelContext(), seed=1)
    model(torch.zeros(2, 16, dtype=torch.long))
    assert len(seen) == 8 and all(isinstance(m, AttentionMask) for m in seen)
    m = _model()
    before = (flops.forward_flops_per_sequence(m, 4096)["attention"],
              memory.layer_activation_bytes(m, 4096, 1, flash_attention=False))
    monkeypatch.setattr(AttentionMask, "counted_pairs",  # a 1024-token window
                        lambda self, lengths: sum(n * min(n, 1024) for n in lengths))
    after = (flops.forward_flops_per_sequence(m, 4096)["attention"],
             memory.layer_activation_bytes(m, 4096, 1, flash_attention=False))
    assert after[0] == before[0] / 4 and after[1] < before[1]


def test_a_new_tokenizer_type_is_a_class_and_a_registry_entry(monkeypatch):
    """Recipe: the class (engine/data/tokenizer.py), its entry in engine/data/tokenizer_spec.TYPES and the
    flag's choice (engine/config/fields.py TOKENIZER_TYPES). Here a type reading integer ids under a new name:
    the flags are checked, the vocabulary resolved and the tokenizer opened with nothing else touched."""
    null = tokenizer_spec.TYPES["NullTokenizer"]
    monkeypatch.setitem(tokenizer_spec.TYPES, "IdsTokenizer", dataclasses.replace(
        null, spec=lambda model, vocab, merges, size: dataclasses.replace(null.spec(model, vocab, merges, size),
                                                                          type="IdsTokenizer")))
    spec = tokenizer_spec.tokenizer_spec("IdsTokenizer", vocab_size=100)
    assert spec.vocab_size() == 101 and spec.build().encode("3 4") == [3, 4]
    cfg = Config()
    cfg.data.tokenizer_type, cfg.model.vocab_size = "IdsTokenizer", 100
    assert tokenizer_spec.data_vocab_size(cfg) == 101

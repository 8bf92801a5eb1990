"""The planner's one parameter inventory (engine/planner/params.py) against the model the engine builds: each
chunk's tensors in the order forward first uses them, element counts and the expert and tied flags the grad
buffer reads, which weights FP8 runs through an Fp8Linear (--fp8-param-gather gathers those as codes), and the
untrained ones; and the one bucket-cutting rule (engine/optim/buckets.py) that the grad
buffer and the planner's replay share."""
import dataclasses
import os

import pytest

from engine import fp8
from engine.cli import parse_config
from engine.fp8.scaling import Recipe
from engine.layout import Layout
from engine.optim.buckets import cut_buckets
from engine.optim.fp8_codes import fp8_weights
from engine.optim.param_shard import forward_order
from engine.parallel.layers import spec_of
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.planner.params import chunk_tensors
from engine.planner.stages import end_ranks, stage_layer_ids
from planner_common import ROOT

GPT2 = dict(num_layers=4)  # LayerNorm, learned positions, biases, tied embedding
MOE = dict(moe_layer_freq="2", moe_router_enable_expert_bias=True, untie_embeddings_and_output_weights=True,
           disable_bias_linear=True, add_qkv_bias=True)
QK_HEAD = dict(num_layers=4, qk_layernorm=True)  # per-head QK-norm with LayerNorm: weights and biases
OLMO2 = dict(num_layers=4, normalization="RMSNorm", qk_layernorm=True, qk_layernorm_scope="projection",
             norm_placement="post")
CASES = [
    ("gpt2-125m", QK_HEAD, Layout(tp=2, pp=2)),
    ("gpt2-125m", OLMO2, Layout(tp=2, pp=2)),
    ("moe-tiny", dict(OLMO2, num_layers=2, moe_layer_freq="[0,1]"), Layout(tp=2, pp=1, dp=2, ep=2)),
    ("gpt2-125m", GPT2, Layout(tp=2, pp=2)),
    ("gpt2-125m", GPT2, Layout(tp=1, pp=1)),
    ("gpt2-125m", GPT2, Layout(pp=2, pipeline_schedule="zb-v")),
    ("moe-tiny", MOE, Layout(tp=2, pp=2, dp=2, ep=2, vpp=2)),
    ("moe-tiny", {}, Layout(tp=2, pp=1, dp=4, ep=4)),
    ("deepseek-v3-tiny", {}, Layout(tp=2, pp=2, dp=2, ep=2)),  # MLA, MTP and its copy of the embedding
    ("deepseek-v3-tiny", dict(q_lora_rank=None, untie_embeddings_and_output_weights=False), Layout(tp=2, pp=1)),
    ("deepseek-v3-tiny", dict(mtp_num_layers=2, moe_layer_freq="[1,1,1,0]"), Layout(pp=2, vpp=2, dp=2, ep=2)),
]


def _config(name: str, model: dict):
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", f"{name}.yaml")])
    if not cfg.data.mock_data and not cfg.data.data_path:
        cfg.data.mock_data = True
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


@pytest.mark.parametrize("name,model,layout", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_chunk_tensors_are_what_the_engine_builds_in_forward_order(name, model, layout):
    cfg = _config(name, model)
    m = cfg.model
    moe = set(m.moe_layers()) if m.num_experts else set()  # (an MTP module's layer is the head's: listed there)
    first, last = end_ranks(layout)
    grid = dataclasses.replace(layout, dp=layout.ep, cp=1)  # the smallest grid holding the ep ranks
    for r, ids in enumerate(stage_layer_ids(m.num_layers, layout)):
        ctx = ParallelContext.virtual(layout=grid, pp_rank=r)
        chunks = build_model_chunks(cfg, ctx, device="meta")
        for chunk in chunks:
            fp8.attach(chunk, Recipe("e4m3", "tensorwise"), ctx)
        linears = fp8_weights(chunks)
        for c, chunk in enumerate(chunks):
            listed = chunk_tensors(m, layout.tp, layout.ep, tuple(i in moe for i in ids[c]), r == first and c == 0,
                                   r == last and c == len(ids) - 1, layout.pp)
            built = [(p.numel(), spec_of(p).ep_axis is not None, spec_of(p).tied, id(p) in linears)
                     for p in forward_order(chunk) if p.requires_grad]  # what the grad buffer lays out
            assert built == [(t.numel, t.expert, t.tied, t.fp8) for _, t in listed if t.trained], (name, layout, r, c)
            frozen = sum(p.numel() for p in chunk.parameters() if not p.requires_grad)
            assert frozen == sum(t.numel for _, t in listed if not t.trained)


def test_cut_buckets_closes_at_the_size_around_alone_items_and_where_the_unit_changes():
    items = [(5, False, 0), (5, False, 0), (3, False, 0), (4, True, 0), (2, False, 0), (1, False, 1)]
    assert cut_buckets(items, 10) == ([0, 0, 1, 2, 3, 4], [10, 3, 4, 2, 1])
    # ZeRO-3: no size limit, whole units
    assert cut_buckets([(50, False, "a"), (50, False, "a"), (7, False, "b")], None) == ([0, 0, 1], [100, 7])
    assert cut_buckets([], 10) == ([], [])

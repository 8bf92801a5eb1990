"""Under torch.compile a decoder layer is one graph, forward and backward: nothing in it makes dynamo stop and run
Python between graphs (a "graph break"), at its first shapes or after the recompilation with dynamic ones. The
H200 run of 2026-11-26 compiled the engine's layers (benchmarks/gpu/loops.compile_layers); on the CPU the
same capture (gpu_check's CPU dry run) showed the break: the switch to the tensor-parallel random stream around
attention (reading a generator's state), taken even with no dropout; and in the frames resumed after it, SDPA's
`enable_gqa` given a symbolic bool (now a plain one). The fused attention CUDA runs in half precision keeps its
backend list under compile, without a break either.

Traced with a counting backend (no inductor) in a process of its own: dynamo's state is process-wide."""
import pytest
from harness import run_in_fresh_process

_CHECK = """
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from engine.config import ModelConfig
from engine.model import GPTModel
from engine.parallel.random import RNGTracker
from engine.parallel.topology import ParallelContext
ctx = ParallelContext()
ctx.rng = RNGTracker.for_context(ctx, seed=1)  # as a training run's context has it
counter = CompileCounter()
for heads, groups in ((4, 2), (4, 4), (8, 2)):  # other head counts make them dynamic sizes too
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                      seq_length=32, vocab_size=128, normalization="RMSNorm", position_embedding_type="rope",
                      swiglu=True, ffn_hidden_size=96, disable_bias_linear=True, attention_backend="sdpa",
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, ctx, pre_process=False, post_process=False).train()
    compiled = torch.compile(model.layers["0"], backend=counter)
    for s, b in ((32, 2), (16, 3)):  # the second shape recompiles with dynamic sizes
        x = torch.randn(s, b, cfg.hidden_size, requires_grad=True)
        positions = torch.arange(s)
        compiled(x, model.rope_freqs(positions), positions).square().sum().backward()
# What `auto` runs on CUDA in half precision (kernels.dispatch._sdpa_fused): its backend priority list, a context
# manager, is captured into the graph, not a break (on the CPU the list leaves SDPA its CPU flash kernel).
from kernels import dispatch
fused = torch.compile(dispatch.attention_fn("sdpa-fused"), backend=counter)
q, k, v = (torch.randn(2, 32, n, 16, requires_grad=True) for n in (4, 2, 2))
out = fused(q, k, v, True, 0.0, None)
assert torch.equal(out, dispatch.attention_fn("sdpa")(q, k, v, True, 0.0, None))
out.sum().backward()
breaks = dict(counters["graph_break"])
assert not breaks and counter.frame_count > 0, breaks
print("one graph")
"""


@pytest.mark.slow  # a fresh process and six dynamo captures: ~9 s
def test_a_decoder_layer_compiles_as_one_graph():
    run_in_fresh_process(_CHECK, "one graph")

"""--fp8-output-layer, one rank: the output layer's three GEMMs in FP8 equal the emulation oracle of tests/test_fp8.py
(quantize, dequantize, fp32 matmul) bit for bit, for every recipe and format; over a tied embedding the weight's
gradient is the FP8 output layer's plus the lookup's, as untied; the flag's misuse is one line; the banner and the
planner know it. Its layouts and its resume: tests/test_fp8_layouts.py.
"""
import pytest
import torch

from engine import fp8
from engine.cli import parse_config
from engine.config import ConfigError
from engine.flops import GPU_PRESETS
from engine.layout import Layout
from engine.model import GPTModel
from engine.parallel.topology import ParallelContext
from engine.planner.software import Software
from engine.planner.step_time import estimate
from engine.report import fp8_lines
from engine.validation import validate
from test_fp8 import RECIPES, _oracle
from tiny_llama import tiny_llama

VOCAB, SEQ, BATCH = 200, 12, 3  # a padded vocabulary of 200: neither a multiple of the 128 tile nor of 16


def _model(fmt, kind, tied=False):
    cfg = tiny_llama(1, SEQ, VOCAB)
    cfg.model.untie_embeddings_and_output_weights = not tied
    ctx = ParallelContext()
    model = GPTModel(cfg.model, ctx, seed=3, vocab_size=VOCAB)
    fp8.attach(model, fp8.Recipe(fmt, kind), ctx, output_layer=True)
    return model


def _logits(model, tokens):
    """(logits [b, s, V], the output layer's input [s, b, h] as the final norm gave it)."""
    seen = []
    handle = model.final_norm.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        return model(tokens), seen[0]
    finally:
        handle.remove()


@pytest.mark.parametrize("fmt,kind", RECIPES)
def test_the_output_layer_equals_the_emulation_oracle_bitwise(fmt, kind):
    model = _model(fmt, kind)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    logits, x = _logits(model, tokens)
    dy = torch.randn(logits.shape, generator=g) * 1e-3
    logits.backward(dy)
    # the oracle's operands in the layer's [s, b] token order: x [s*b, h], W [V, h], dy [s*b, V]
    w = model.output.detach()
    y, _, dw = _oracle(x.reshape(-1, x.shape[-1]), w, dy.transpose(0, 1).reshape(-1, w.shape[0]), fmt,
                       kind == "blockwise")
    assert model.head_fp8.input.last is not None  # the output layer's GEMMs ran through its Fp8Linear
    for name, got, want in (("logits", logits.transpose(0, 1).reshape(-1, w.shape[0]), y), ("dw", model.output.grad,
                                                                                           dw)):
        assert torch.equal(got, want), f"{fmt} {kind} {name}: {(got - want).abs().max()}"


def test_a_tied_weight_takes_the_fp8_output_layers_gradient_and_the_lookups():
    """Over a tied embedding the one weight gets both uses' gradients: what the untied model gives its output
    weight and its embedding apart, summed (the same numbers: the same weights, the same tokens)."""
    tied, untied = _model("hybrid", "delayed", tied=True), _model("hybrid", "delayed")
    with torch.no_grad():
        untied.word.weight.copy_(tied.word.weight)
        untied.output.copy_(tied.word.weight)
        for a, b in zip(tied.layers.parameters(), untied.layers.parameters()):
            b.copy_(a)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))
    for model in (tied, untied):
        logits, _ = _logits(model, tokens)
        logits.float().pow(2).mean().backward()
    assert tied.head_fp8 is not None and fp8.OUTPUT_LAYER in fp8.linears([tied])
    want = untied.output.grad + untied.word.weight.grad
    assert torch.equal(tied.word.weight.grad, want), \
        (tied.word.weight.grad - want).abs().max()
    assert untied.word.weight.grad.abs().max() > 0 and untied.output.grad.abs().max() > 0  # both uses counted


def test_the_flag_without_fp8_is_one_line_and_the_banner_says_it():
    with pytest.raises(ConfigError, match="--fp8-output-layer.*add --fp8-format"):
        validate(parse_config(["--mock-data", "--fp8-output-layer"]), 1)
    on = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    line, = fp8_lines(parse_config(on + ["--fp8-output-layer"]))
    assert "output layer GEMMs (--fp8-output-layer)" in line and "the attention core and the rest in bf16" in line
    line, = fp8_lines(parse_config(on))
    assert "the output layer, attention core and the rest in bf16" in line


def test_the_planner_prices_the_output_layer_in_fp8():
    """The 1.24B Llama (128k vocabulary, a fifth of its GEMM work in the output layer): with the flag the output
    layer's GEMMs run at the FP8 rate, less its casts' traffic, so the step is shorter; blockwise (dequantized, at
    the bf16 rate) only pays the casts."""
    cfg = parse_config(["--config", "configs/llama3-1b.yaml", "--seq-length", "2048",
                        "--max-position-embeddings", "2048"])
    gpu, layout = GPU_PRESETS["h100-sxm"], Layout(micro_batch_size=8)

    def step(**sw):
        return estimate(cfg.model, layout, gpu, 16, 2048, software=Software(**sw)).step_time_s
    for recipe in ("tensorwise", "delayed"):
        hidden, both = step(fp8=recipe), step(fp8=recipe, fp8_output_layer=True)
        assert 0.9 * hidden < both < 0.97 * hidden, (recipe, hidden, both)
    assert step(fp8="blockwise", fp8_output_layer=True) > step(fp8="blockwise")
    assert step(fp8_output_layer=True) == step()  # no FP8 recipe: nothing changes


def _held_bytes(keepers) -> int:
    """The bytes of the FP8 weights the keepers hold now: each linear's codes and their transpose, each routed
    expert's codes."""
    total = 0
    for k in keepers:
        if isinstance(k.held, dict):  # Fp8Experts: id(weight) -> its codes
            total += sum(q.data.numel() for g in k.held.values() for q in g.q)
        elif k.held is not None:
            total += k.held.q.data.numel() + (k.held.t.data.numel() if k.held.t is not None else 0)
    return total


@pytest.mark.parametrize("moe", [False, True])
def test_the_planner_counts_the_fp8_weights_a_step_holds(moe):
    """Within a schedule of 2 microbatches the engine keeps each FP8 weight quantized (engine.fp8.weights_held):
    after the first microbatch's forward and backward, the bytes it holds are the planner's (fp8_held_bytes), the
    output layer's included; none with one microbatch or under ZeRO-3; and the banner's estimate adds them, and the
    logits' gradient's codes."""
    from engine.planner.memory import fp8_held_bytes, memory_per_gpu
    cfg = tiny_llama(2, SEQ, VOCAB, moe)
    cfg.model.untie_embeddings_and_output_weights = False
    ctx = ParallelContext()
    model = GPTModel(cfg.model, ctx, seed=3, vocab_size=VOCAB)
    fp8.attach(model, fp8.Recipe("hybrid", "delayed"), ctx, output_layer=True)
    keepers = fp8.keepers([model])
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(9))
    with fp8.weights_held(keepers, 2):
        model(tokens, labels=tokens).mean().backward()
        held = _held_bytes(keepers)
    layout = Layout(micro_batch_size=1)
    assert held > 0 and held == fp8_held_bytes(cfg.model, layout, 0, 2, output_layer=True)
    assert fp8_held_bytes(cfg.model, layout, 0, 1, output_layer=True) == 0
    assert fp8_held_bytes(cfg.model, Layout(dp=2, sharding_strategy="optim_grads_params"), 0, 2, True) == 0
    plain, fp8_run = (memory_per_gpu(cfg.model, layout, SEQ, 2, "fp32", fp8=recipe, fp8_output_layer=True)
                      for recipe in (None, "delayed"))
    # and at the output layer's backward the logits' gradient as codes and their transpose: 2 bytes a logit
    assert fp8_run.fp8_held == held and fp8_run.logits - plain.logits == 2 * SEQ * VOCAB
    assert fp8_run.allocated - plain.allocated == held + 2 * SEQ * VOCAB

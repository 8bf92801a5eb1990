"""QK-norm (--qk-layernorm, engine/parallel/qk_norm.py) and norms after the sublayers (--norm-placement post).

Against transformers (fp32, CPU): one decoder layer of ours with the weights of a transformers Qwen3 layer
(per-head QK-norm, its own head_dim, pre-norms) and of an OLMo-2 layer (QK-norm over the whole projection,
norms after attention and after the MLP), every weight random: the output, the input's gradient and every
weight's gradient equal transformers' (1e-5 of their scale).

Against one rank: a two-layer model at tp 2 (x dp 2, with and without sequence parallelism) for each form,
LayerNorm and RMSNorm per head, and pre and post placement: loss and every parameter's gradient, as the grad
buffer leaves them (the per-head weights' partial gradients summed over tp), gathered, equal tp 1's (1e-5).
And the bytes a layer keeps for backward with QK-norm, measured, against the planner's count.
Budget: about 12 s alone, most of it starting the pool of 4 ranks (shared with the other tests).
"""
import dataclasses

import pytest
import torch

from engine.checkpoint.hf.transforms import QKV
from engine.cli import parse_config
from engine.config import ConfigError, ModelConfig
from engine.model import GPTModel
from engine.parallel.layers import init_weights, local_slice, spec_of
from engine.parallel.topology import ParallelContext, build_context
from engine.validation import validate
from harness import NO_DROPOUT, full_grad, grad_buffer, run_ranks

SEQ, BATCH, VOCAB = 8, 2, 50


def lib():
    return pytest.importorskip("transformers")


def _model_cfg(**changes) -> ModelConfig:
    """RMSNorm, rope, SwiGLU, no biases; 4 heads in 2 groups of head_dim 16 (not hidden / heads)."""
    m = ModelConfig(**NO_DROPOUT, num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                    ffn_hidden_size=48, seq_length=SEQ, vocab_size=VOCAB, normalization="RMSNorm",
                    position_embedding_type="rope", swiglu=True, disable_bias_linear=True, norm_epsilon=1e-6,
                    qk_layernorm=True)
    return dataclasses.replace(m, **changes)


def _hf_layer(kind: str):
    """A transformers decoder layer of `kind` (qwen3 | olmo2) with random weights, and its rotary embedding."""
    t = lib()
    shape = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-6, attn_implementation="sdpa")
    config, layer, rope = {"qwen3": (t.Qwen3Config, "Qwen3DecoderLayer", "Qwen3RotaryEmbedding"),
                           "olmo2": (t.Olmo2Config, "Olmo2DecoderLayer", "Olmo2RotaryEmbedding")}[kind]
    config = config(**shape)
    modeling = getattr(getattr(t.models, kind), f"modeling_{kind}")
    hf = getattr(modeling, layer)(config, layer_idx=0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # norm weights away from 1, projections at a scale that keeps logits moving
            p.copy_(1.0 + torch.randn(p.shape) * 0.3 if p.ndim == 1 else torch.randn(p.shape) * 0.2)
    return hf, getattr(modeling, rope)(config)


def _ours_from(hf, kind: str, m: ModelConfig):
    """Our one-layer stage (no embedding, no head) holding the transformers layer's weights."""
    ours = GPTModel(m, ParallelContext.virtual(), pre_process=False, post_process=False)
    a, mlp, params = hf.self_attn, hf.mlp, dict(ours.named_parameters())
    norms = {"qwen3": ("input_layernorm", "post_attention_layernorm"),
             "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm")}[kind]
    with torch.no_grad():
        for j, proj in enumerate((a.q_proj, a.k_proj, a.v_proj)):
            QKV.of(m, j).into(params["layers.0.attention.qkv.weight"], proj.weight)
        pairs = {"attention.proj.weight": a.o_proj.weight, "attention.qk_norm.q.weight": a.q_norm.weight,
                 "attention.qk_norm.k.weight": a.k_norm.weight, "mlp.fc2.weight": mlp.down_proj.weight,
                 "norm1.weight": getattr(hf, norms[0]).weight, "norm2.weight": getattr(hf, norms[1]).weight}
        for name, weight in pairs.items():
            params["layers.0." + name].copy_(weight)
        params["layers.0.mlp.fc1.weight"].copy_(torch.stack((mlp.gate_proj.weight, mlp.up_proj.weight)))
    return ours, pairs


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_one_layer_and_its_gradients_equal_transformers(kind):
    m = _model_cfg(qk_layernorm_scope="head" if kind == "qwen3" else "projection",
                   norm_placement="pre" if kind == "qwen3" else "post")
    hf, rope = _hf_layer(kind)
    ours, pairs = _ours_from(hf, kind, m)
    x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(1))
    out_grad = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ)
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    y_hf = hf(x_hf, attention_mask=None, position_ids=positions[None], position_embeddings=rope(x, positions[None]))
    y_hf = y_hf[0] if isinstance(y_hf, tuple) else y_hf
    y_ours = ours(hidden=x_ours, positions=positions).transpose(0, 1)
    (y_hf * out_grad).sum().backward()
    (y_ours * out_grad).sum().backward()

    def close(a, b):
        return (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    assert close(y_ours, y_hf) and y_hf.std() > 0.1
    assert close(x_ours.grad.transpose(0, 1), x_hf.grad)
    params = dict(ours.named_parameters())
    for name, weight in pairs.items():
        assert close(params["layers.0." + name].grad, weight.grad), name


def test_the_flags_and_their_mistakes():
    cfg = parse_config(["--mock-data", "--qk-layernorm", "--qk-layernorm-scope", "projection", "--normalization",
                        "RMSNorm", "--norm-placement", "post"])
    assert (cfg.model.qk_layernorm, cfg.model.qk_layernorm_scope, cfg.model.norm_placement) == \
        (True, "projection", "post")
    validate(cfg, 1)
    for argv in (["--qk-layernorm-scope", "projection", "--normalization", "RMSNorm"],
                 ["--qk-layernorm", "--qk-layernorm-scope", "projection"]):
        with pytest.raises(ConfigError, match="--qk-layernorm-scope projection: is RMSNorm over the whole q and k"):
            validate(parse_config(["--mock-data", *argv]), 1)


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_in_bf16_the_norms_compute_in_fp32_and_return_bf16(scope):
    from engine.parallel.qk_norm import QKNorm
    m, g = _model_cfg(qk_layernorm_scope=scope), torch.Generator().manual_seed(4)
    q, k = torch.randn(SEQ, BATCH, 4, 16, generator=g) * 3, torch.randn(SEQ, BATCH, 2, 16, generator=g) * 3
    norms = [QKNorm(m, ParallelContext.virtual(), dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    for norm in norms:
        init_weights(norm, ParallelContext.virtual(), seed=1)
    want, got = norms[0](q, k), norms[1](q.bfloat16(), k.bfloat16())
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and (a.float() - b).abs().max().item() < 2e-2 * b.abs().max().item()


def test_what_it_keeps_for_backward_and_the_planner_counts():
    """QK-norm keeps its inputs q and k and 1/rms (per token and head, or per token for the whole projection),
    nothing more (no normalised copy, no view pinning the fused QKV output); post placement keeps as much as
    pre. The planner counts the inputs (2-byte units, x 2 here in fp32)."""
    from benchmarks.memory import MICRO, SEQ as S, llama_config, measure
    from engine.planner.activations import layer_activation_bytes
    base = llama_config("none")
    q_k = S * MICRO * (base.num_attention_heads + base.resolved_query_groups())
    for changes, rstd in ((dict(qk_layernorm=True), q_k * 4), (dict(qk_layernorm=True, qk_layernorm_scope="projection",
                                                                    norm_placement="post"), S * MICRO * 2 * 4)):
        cfg = dataclasses.replace(base, **changes)
        grown = measure(cfg, ParallelContext.virtual(), torch.device("cpu"))[0] - \
            measure(base, ParallelContext.virtual(), torch.device("cpu"))[0]
        assert grown == q_k * base.head_dim() * 4 + rstd, changes
        planned = layer_activation_bytes(cfg, S, MICRO, flash_attention=True) - \
            layer_activation_bytes(base, S, MICRO, flash_attention=True)
        assert 2 * planned == q_k * base.head_dim() * 4


# ---------------------------------------------------------------- tp 2 against one rank

TP_CASES = [dict(qk_layernorm_scope="head"), dict(qk_layernorm_scope="head", normalization="LayerNorm"),
            dict(qk_layernorm_scope="projection"), dict(qk_layernorm_scope="projection", norm_placement="post"),
            dict(qk_layernorm_scope="head", norm_placement="post", num_query_groups=4)]


def _nudged(model, ctx):
    """Every parameter moved by noise drawn from its name as a full tensor, this rank taking its slice."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = spec_of(p)
            g = torch.Generator().manual_seed(sum(map(ord, name)))
            p.add_(local_slice(torch.randn(spec.full_shape, generator=g) * 0.2, spec, ctx))
    return model


def _tp2_cases(rank, world, cases):
    """Each case at tp 2 x dp 2 (both replicas on the same batch), without and with sequence parallelism:
    failures against tp 1 computed in this process."""
    g = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    failures = []
    for changes in cases:
        m = _model_cfg(num_layers=2, **changes)
        ref = _nudged(GPTModel(m, ParallelContext.virtual()), ParallelContext.virtual())
        ref_loss = ref(tokens, labels=labels).mean()
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for sp in (False, True):
            ctx = build_context(world, rank, 2, 1, sequence_parallel=sp)
            model = _nudged(GPTModel(m, ctx), ctx)
            buffer = grad_buffer([model], ctx)
            loss = model(tokens, labels=labels).mean()
            loss.backward()
            buffer.finish()
            what = f"{changes} sp={sp}"
            if abs(loss.item() - ref_loss.item()) > 1e-5:
                failures.append(f"{what}: loss {loss.item()} vs {ref_loss.item()}")
            for name, p in model.named_parameters():
                got, want = full_grad(p, ctx), ref_grads[name][:spec_of(p).valid_rows]
                if (got - want).abs().max().item() > 1e-5 * max(want.abs().max().item(), 1.0):
                    failures.append(f"{what}: grad {name}")
            ctx.destroy()
    return failures


def test_at_tp2_with_and_without_sp_loss_and_gradients_equal_one_rank():
    results = run_ranks(_tp2_cases, 4, TP_CASES)
    assert results == [[]] * 4, results[0]

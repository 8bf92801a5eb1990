"""Topology, tensor-parallel layers, sequence parallelism and the model against one rank (fp32, CPU)."""
import pytest
import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.model import GPTModel
from engine.parallel.topology import ParallelContext, build_context, coords, layout_table, rank_grid
from harness import NO_DROPOUT, full_grad, grad_buffer, run_ranks

VOCAB = 100  # padded to 128, 256 or 512 depending on tp: the padding must not change the loss


def gpt2_style(**kw):
    return ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
                       make_vocab_size_divisible_by=128, **kw)


def llama_style(**kw):
    return ModelConfig(**NO_DROPOUT, num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, seq_length=16,
                       vocab_size=VOCAB, make_vocab_size_divisible_by=128, normalization="RMSNorm",
                       position_embedding_type="rope", swiglu=True, disable_bias_linear=True,
                       untie_embeddings_and_output_weights=True, **kw)


def batch(seed, b=2, s=16):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- topology (no process group needed)

def test_groups_follow_megatron_order_world16_tp2_pp4():
    g = rank_grid(16, 2, 4)
    assert g["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert g["dp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert g["embedding"][0] == [0, 12]


def test_groups_partition_the_world_for_many_layouts():
    for world in (8, 16):
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8):
                if world % (tp * pp):
                    continue
                dp = world // (tp * pp)
                g = rank_grid(world, tp, pp)
                for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
                    members = sorted(r for grp in g[kind] for r in grp)
                    assert members == list(range(world)), (world, tp, pp, kind)
                    assert all(len(grp) == size for grp in g[kind])
                for r in range(world):
                    t, d, p = coords(r, tp, dp)
                    assert r == t + tp * (d + dp * p)
                    assert next(grp for grp in g["tp"] if r in grp) == [r - t + i for i in range(tp)]
                    pp_group = next(grp for grp in g["pp"] if r in grp)
                    assert pp_group == [t + tp * d + tp * dp * i for i in range(pp)]


def test_layout_table_names_nodes():
    text = layout_table(16, 2, 4, gpus_per_node=8)
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "node", "tp", "pp", "dp"]
    assert lines[1 + 9].split() == ["9", "1", "1", "2", "0"]


def test_virtual_context_coordinates():
    ctx = ParallelContext.virtual(tp=2, pp=4, dp=2, tp_rank=1, pp_rank=3, dp_rank=1)
    assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank) == (1, 1, 3)
    assert ctx.is_last_stage and not ctx.is_first_stage
    assert ctx.pp_ranks == [3, 7, 11, 15]


# ---------------------------------------------------------------- multi-rank equivalence

STYLES = {"gpt2": gpt2_style, "llama": llama_style}
TP_LAYOUTS = [(style, tp, sp) for style in STYLES for tp in (1, 2, 4) for sp in ((False, True) if tp > 1 else (False,))]
# What the HF import needs, one layout each: Qwen2's QKV-only bias with Llama 3 RoPE scaling (an original
# context of 8 scales frequencies within the 16 tokens), and GPT-2's tanh GELU (exact is the default).
STYLES |= {"qwen2-rope3": lambda: llama_style(add_qkv_bias=True, use_rope_scaling=True,
                                              rope_scaling_original_max_position_embeddings=8),
           "gpt2-tanh": lambda: gpt2_style(openai_gelu=True)}
TP_LAYOUTS += [("qwen2-rope3", 2, True), ("gpt2-tanh", 2, False)]


def _tp_case(rank, world, style, tp, sp):
    """Loss and every full gradient of one layout against the same model on one rank (4 ranks: dp 4 / tp)."""
    tokens, labels = batch(7)
    ref = GPTModel(STYLES[style](), ParallelContext(), seed=11)
    ref_loss = ref(tokens, labels=labels).mean()
    ref_loss.backward()
    ref_grads = {n: full_grad(p, ParallelContext(), p.grad) for n, p in ref.named_parameters()}
    ctx = build_context(world, rank, tp, 1, sequence_parallel=sp)
    model = GPTModel(STYLES[style](), ctx, seed=11)
    grads = grad_buffer([model], ctx)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    grads.finish()
    failures = [] if abs(loss.item() - ref_loss.item()) <= 1e-5 else [f"loss {loss.item()} vs {ref_loss.item()}"]
    for name, p in model.named_parameters():
        want = ref_grads[name]
        err = (full_grad(p, ctx) - want).abs().max().item()
        if err > 1e-5 * want.abs().max().item() + 1e-7:
            failures.append(f"grad {name} max err {err:.3g} (scale {want.abs().max().item():.3g})")
    ctx.destroy()
    return failures


@pytest.mark.parametrize("style,tp,sp", TP_LAYOUTS, ids=[f"{s}-tp{t}{'-sp' if sp else ''}" for s, t, sp in TP_LAYOUTS])
def test_tp_loss_and_gradients_match_single_rank(style, tp, sp):
    results = run_ranks(_tp_case, 4, style, tp, sp)
    assert results[0] == [], "\n".join(results[0])
    assert all(r == [] for r in results), results


def _curve(rank, world, tp, sp, steps):
    ctx = build_context(world, rank, tp, 1, sequence_parallel=sp) if tp > 1 else ParallelContext()
    model = GPTModel(llama_style(), ctx, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    grads, losses = grad_buffer([model], ctx), []
    for step in range(steps):
        tokens, labels = batch(100 + step % 2)  # two batches, revisited: the loss must fall
        grads.start_step(1)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        grads.finish()
        for p in model.parameters():
            p.grad = p.main_grad.clone()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if tp > 1:
        ctx.destroy()
    return losses


def _curves(rank, world):
    return _curve(rank, world, 1, False, 20), _curve(rank, world, 2, True, 20)


def test_training_curve_tp2_sequence_parallel_matches_tp1():
    for single, parallel in run_ranks(_curves, 2, timeout=300):
        assert single[-1] < single[0], "the loss should fall"
        diff = max(abs(a - b) for a, b in zip(single, parallel))
        assert diff < 1e-4, (diff, single, parallel)


def _dropout_streams(rank, world):
    ctx = build_context(world, rank, 2, 1, seed=5)
    x = torch.ones(1000)
    with ctx.rng.fork():
        split = torch.nn.functional.dropout(x, 0.5)
    replicated = torch.nn.functional.dropout(x, 0.5)
    masks = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(masks[0], split, group=ctx.tp_group)
    dist.all_gather(masks[1], replicated, group=ctx.tp_group)
    ctx.destroy()
    return bool(torch.equal(*masks[0])), bool(torch.equal(*masks[1]))


def test_rng_tracker_splits_and_replicates_dropout():
    for split_equal, replicated_equal in run_ranks(_dropout_streams, 2):
        assert not split_equal, "dropout on split activations must differ across TP ranks"
        assert replicated_equal, "dropout on replicated activations must match across TP ranks"

"""Packed documents (--reset-attention-mask, --reset-position-ids, with --eod-mask-loss): the door, the mask and
every kernel path, the FLOP count and the planner, the flags and the data.

The oracles are independent of the code under test: megatron-core's _get_ltor_masks_and_position_ids for what
the door reads off the tokens (position ids, and the mask as Megatron materialises it), and attention over a
mask built here pair by pair from "a query sees a key iff both are in one document and the key is not later"
(and within the window). Checked against it in fp32: the reference, SDPA and Triton (interpreter on CPU) kernels,
values and gradients, the Triton programs' visited blocks counted against the blocks holding a visible pair, the
block kernels of the ring at offsets merged by their log-sum-exp; the ring's plan skipping steps whose keys share
no document with their queries; RoPE with per-sample angles. Whole models and the layouts:
tests/test_packed_layouts.py. Budget on two cores: about 15 s.
"""
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

import test_kernels as tk  # first: on CPU it points Triton at its interpreter before any kernel is defined
from engine import flops
from engine.attention_mask import AttentionMask, mean_keys_per_query, packed_lengths
from engine.cli import parse_config
from engine.config import Config, ConfigError, ModelConfig
from engine.data.indexed_dataset import IndexedDatasetWriter
from engine.documents import Documents, Packing, document_bounds
from engine.flops import GPU_PRESETS
from engine.layout import Layout
from engine.parallel import context_split, ring_attention
from engine.parallel.topology import ParallelContext
from engine.planner.layer_time import _attention_seconds
from engine.planner.software import Software
from engine.planner.step_time import estimate
from engine.validation import validate
from harness import NO_DROPOUT
from kernels import dispatch, reference

EOD = 63


def packed_tokens(n: int, s: int, seed: int, longest: int = 13) -> torch.Tensor:
    """[n, s] tokens below EOD with an EOD ending each document of random length 1..longest (so some documents
    are a lone EOD, and the last one runs past the end of the sample)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, EOD, (n, s), generator=g)
    for row in t:
        at = int(torch.randint(1, longest + 1, (1,), generator=g))
        while at <= s:
            row[at - 1] = EOD
            at += int(torch.randint(1, longest + 1, (1,), generator=g))
    return t


def megatron_masks(tokens: torch.Tensor) -> tuple:
    """megatron-core's (visible [b, s, s] bool, position ids [b, s]) of each sample, with both resets."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    masks, ids = [], []
    for row in tokens:
        hidden, _, pos = _get_ltor_masks_and_position_ids(row, EOD, True, True, False, True)
        masks.append(~hidden[0])  # Megatron's mask is True where attention is masked out
        ids.append(pos)
    return torch.stack(masks), torch.stack(ids)


def visible_pairs(tokens: torch.Tensor, window=None) -> torch.Tensor:
    """[b, s, s] bool, pair by pair: the query at i sees the key at j iff no EOD lies in tokens[j:i] (one document),
    j <= i, and i - j <= window when a window is set."""
    b, s = tokens.shape
    out = torch.zeros(b, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(i + 1):
                out[r, i, j] = not (tokens[r, j:i] == EOD).any() and (window is None or i - j <= window)
    return out


def oracle(q, k, v, seen):
    """Softmax attention over the materialised per-sample mask `seen` [b, s, s], grouped-query heads repeated."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~seen[:, None], float("-inf")).softmax(-1), v)


def documents_of(tokens: torch.Tensor) -> Documents:
    return Packing(EOD, reset_attention_mask=True).apply(tokens)[1]


def qkv(b=2, s=45, nq=4, nkv=2, d=16, seed=5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(device) for n in (nq, nkv, nkv)]


# ---------------------------------------------------------------- the door against megatron-core


def test_the_door_reads_documents_and_position_ids_as_megatron_does():
    tokens = packed_tokens(4, 40, seed=1)
    tokens[3] = torch.arange(40) % EOD  # no EOD at all: one document, positions unchanged
    tokens[2, 0] = tokens[2, 1] = EOD    # documents of one token each, at the start
    want_mask, want_ids = megatron_masks(tokens)
    ids, docs = Packing(EOD, True, True).apply(tokens)
    assert torch.equal(ids, want_ids)
    positions = torch.arange(40)
    assert torch.equal(reference.visible(positions, positions, True, None, docs.bounds), want_mask)
    assert torch.equal(want_mask, visible_pairs(tokens))
    first, last = document_bounds(tokens, EOD)
    assert docs.lengths()[3] == [40] and docs.lengths()[2][:2] == [1, 1]
    assert [sum(n) for n in docs.lengths()] == [40] * 4
    for row, lengths in zip(last.tolist(), docs.lengths()):  # each document's last position, from its lengths
        assert sorted(set(row)) == (np.cumsum(lengths) - 1).tolist()
    assert Packing(EOD).apply(tokens) == (None, None)  # no reset asked: nothing computed
    assert Packing(EOD, reset_position_ids=True).apply(tokens)[1] is None
    assert Packing(EOD, reset_attention_mask=True).apply(tokens)[0] is None


def test_the_door_cuts_position_ids_for_cp_and_keeps_the_documents_whole():
    tokens = packed_tokens(2, 16, seed=2)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 16)}
    ids, _ = Packing(EOD, True, True).apply(tokens)
    for cp in (1, 2, 4):
        for rank in range(cp):
            ctx = ParallelContext.virtual(cp=cp, cp_rank=rank)
            mine = context_split.shard_batch(batch, ctx, Packing(EOD, True, True))
            assert torch.equal(mine["positions"], context_split.positions(16, cp, rank))
            assert torch.equal(mine["position_ids"], ids[:, mine["positions"]])
            assert mine["documents"].bounds.shape == (2, 2, 16)  # whole: read at absolute positions
    plain = context_split.shard_batch(batch, ParallelContext.virtual(cp=2, cp_rank=1))
    assert plain["position_ids"] is plain["positions"] and plain["documents"] is None  # the fast path


# ---------------------------------------------------------------- the mask's questions about ranges


def test_the_mask_decides_ranges_with_documents_as_pair_by_pair():
    tokens = packed_tokens(3, 24, seed=3, longest=7)
    docs = documents_of(tokens)
    for window in (None, 2, 5):
        mask = AttentionMask(window=window).within(docs)
        seen = visible_pairs(tokens, window)
        for q0, k0 in ((0, 0), (8, 0), (8, 4), (12, 3), (20, 16), (4, 12)):
            block = seen[:, q0:q0 + 4, k0:k0 + 4]
            queries, keys = range(q0, q0 + 4), range(k0, k0 + 4)
            assert mask.sees_any(queries, keys) == bool(block.any()), (window, q0, k0)
            assert mask.sees_all(queries, keys) == bool(block.all()), (window, q0, k0)
            assert mask.pairs(queries, keys, samples=3) == int(block.sum()), (window, q0, k0)
    assert AttentionMask(window=3).within(None) == AttentionMask(window=3)


def test_the_ring_skips_steps_whose_keys_share_no_document_with_their_queries():
    """cp 4, chunks of 4: documents of 4 tokens aligned with the chunks see only their own chunk, so each rank
    computes its two diagonal blocks and the ring takes no step past its own K/V."""
    tokens = torch.zeros(1, 32, dtype=torch.long)
    tokens[0, 3::4] = EOD
    mask = AttentionMask().within(documents_of(tokens))
    for rank in range(4):
        steps = ring_attention.plan(4, rank, 4, mask, 1)
        assert [(i, [(b.q, b.k) for b in blocks]) for i, _, blocks in steps] == [(0, [(0, 0), (1, 1)])]
        assert sum(b.pairs for _, _, blocks in steps for b in blocks) == 2 * 10  # 4 * 5 / 2 per chunk
    tokens[0, 3] = 0  # the first document now spans chunks 0 and 1: rank 1 needs rank 0's keys, one step on
    mask = AttentionMask().within(documents_of(tokens))
    plans = [ring_attention.plan(4, rank, 4, mask, 1) for rank in range(4)]
    assert [[i for i, _, _ in steps] for steps in plans] == [[0, 1]] * 4  # every rank posts the same transfers
    assert [[len(blocks) for _, _, blocks in steps] for steps in plans] == [[2, 0], [2, 1], [2, 0], [2, 0]]


# ---------------------------------------------------------------- kernels against the materialised mask


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_reference_and_sdpa_equal_the_materialised_mask(backend):
    tokens = packed_tokens(2, 23, seed=4, longest=9)
    bounds = documents_of(tokens).bounds
    for window in (None, 3):
        seen = visible_pairs(tokens, window)
        tk._compare(lambda *t: dispatch.attention(*t, backend=backend, window=window, doc_bounds=bounds),
                    lambda *t: oracle(*t, seen), qkv(s=23, d=8))
    q, k, _ = qkv(s=23, d=8)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / math.sqrt(8)
    lse = scores.masked_fill(~visible_pairs(tokens)[:, None], float("-inf")).logsumexp(-1)
    assert tk._rel_err(reference.attention_lse(q, k, doc_bounds=bounds), lse) < 1e-6


def _touched(seen: torch.Tensor, rows: int, cols: int) -> int:
    """Blocks of rows x cols of each sample's mask holding a visible pair, summed over the samples."""
    s = seen.shape[1]
    return sum(bool(seen[r, i:i + rows, j:j + cols].any()) for r in range(seen.shape[0])
               for i in range(0, s, rows) for j in range(0, s, cols))


@tk.needs_triton
def test_triton_with_documents_equals_the_materialised_mask_and_skips_the_hidden_blocks():
    """Values, lse and gradients, and the blocks each kernel's loops visit: exactly those holding a visible pair,
    so short documents cost their squares: far fewer blocks than the causal triangle."""
    fa = tk._tk("flash_triton")
    b, s, nq, nkv, d = 2, 70, 2, 1, 16
    (bm, bn, _, _), (m1, n1, _, _), (m2, n2, _, _) = fa._configs(d, torch.float32, tk.CUDA)
    tokens = packed_tokens(b, s, seed=6, longest=20)
    tokens[1, 39] = EOD  # a boundary on a block edge
    bounds = documents_of(tokens).bounds.to(tk.DEVICE)
    visited = {}
    for window in (None, 6):
        seen = visible_pairs(tokens, window)
        q, k, v = qkv(b, s, nq, nkv, d, device=tk.DEVICE)
        with fa.counting() as visits:
            tk._compare(lambda *t: fa.flash_attention(*t, window=window, doc_bounds=bounds),
                        lambda *t: oracle(*t, seen.to(tk.DEVICE)), [q, k, v])
        _, lse = fa.forward(q, k, v, True, None, window, doc_bounds=bounds)
        assert tk._rel_err(lse, reference.attention_lse(q, k, window=window, doc_bounds=bounds)) < 1e-5
        want = {"forward": nq * _touched(seen, bm, bn), "dkdv": nq * _touched(seen, m1, n1),
                "dq": nq * _touched(seen, m2, n2)}
        assert visits == want, (window, visits, want)
        visited[window] = visits["forward"]
    causal = nq * _touched(visible_pairs(torch.zeros(b, s, dtype=torch.long)), bm, bn)
    assert visited[6] <= visited[None] < causal  # documents' blocks skipped, not only masked


def _blockwise(q, k, v, window, bounds, backend, chunks=4):
    """Attention as the ring computes it, on one process: chunk pairs with any visible pair, each by the block
    kernels at its positions (the whole sequence's documents), merged by lse; backward from the merged lse."""
    fwd, bwd = dispatch.attention_block_fns(backend)
    mask, c = AttentionMask(window=window).within(documents_of_bounds(bounds)), q.shape[1] // chunks
    part = lambda t, i: t[:, i * c:(i + 1) * c]  # noqa: E731
    pairs = [(i, j) for i in range(chunks) for j in range(chunks)
             if mask.sees_any(range(i * c, (i + 1) * c), range(j * c, (j + 1) * c))]
    acc = [None] * chunks
    args = lambda i, j: dict(window=window, q_offset=i * c, k_offset=j * c, doc_bounds=bounds)  # noqa: E731
    for i, j in pairs:
        acc[i] = ring_attention._merge(acc[i], *fwd(part(q, i), part(k, j), part(v, j), True, None, **args(i, j)))
    out, lse = torch.cat([a[0] for a in acc], 1).to(q.dtype), torch.cat([a[1] for a in acc], 2)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.device, q.dtype)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, j in pairs:
        g = bwd(part(do, i), part(q, i), part(k, j), part(v, j), part(out, i), lse[..., i * c:(i + 1) * c], True,
                None, **args(i, j))
        for total, got, at in zip(grads, g, (i, j, j)):
            part(total, at).add_(got.float())
    return out, do, grads, len(pairs)


def documents_of_bounds(bounds: torch.Tensor) -> Documents:
    return Documents(bounds[0], bounds[1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=tk.needs_triton)])
def test_block_kernels_at_offsets_merge_to_document_attention(backend):
    """Blocks whose rows partly see nothing merge exactly; blocks sharing no document are not run."""
    tokens = torch.full((2, 32), 5)
    tokens[0, [7, 8, 20]] = EOD  # sample 0: documents 0-7, 8, 9-20, 21-31
    tokens[1, [15]] = EOD        # sample 1: 0-15, 16-31: chunks 0, 1 and 2, 3 share no document
    for window in (None, 4) if backend == "reference" else (4,):  # (the interpreter is slow)
        seen = visible_pairs(tokens, window)
        q, k, v = (tk._leaf(t) for t in qkv(s=32, device=tk.DEVICE))
        bounds = documents_of(tokens).bounds.to(tk.DEVICE)
        out, do, grads, blocks = _blockwise(q.detach(), k.detach(), v.detach(), window, bounds, backend)
        want = oracle(q, k, v, seen.to(tk.DEVICE))
        want.backward(do)
        assert tk._rel_err(out, want) < 1e-5 and blocks == {None: 7, 4: 7}[window], blocks
        for got, leaf in zip(grads, (q, k, v)):
            assert tk._rel_err(got, leaf.grad) < 1e-5, window


def _rope_oracle(x, ids, d):
    """x [s, b, n, d] rotated by each sample's own positions, one sample at a time with the shared-table path."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    return torch.cat([reference.apply_rope(x[:, i:i + 1], torch.outer(ids[i].float(), inv))
                      for i in range(x.shape[1])], dim=1)


@pytest.mark.parametrize("kernel", ["reference", pytest.param("rope_triton", marks=tk.needs_triton)])
def test_rope_takes_per_sample_angles(kernel):
    tokens = packed_tokens(3, 12, seed=7, longest=5)
    ids, _ = Packing(EOD, reset_position_ids=True).apply(tokens)
    x = torch.randn(12, 3, 2, 16, generator=torch.Generator().manual_seed(8)).to(tk.DEVICE)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    freqs = (ids.t().float().unsqueeze(-1) * inv).to(tk.DEVICE)  # [s, b, d/2], as the model builds them
    fn = reference.apply_rope if kernel == "reference" else tk._tk(kernel).apply_rope
    tk._compare(fn, lambda x, f: _rope_oracle(x.cpu(), ids, 16).to(x.device), [x, freqs], constant=(1,))


def test_flash_attn_varlen_form_of_the_documents():
    """cu_seqlens, what flash-attn's varlen API and torch's varlen_attn take: every sample's documents in turn."""
    tokens = packed_tokens(3, 20, seed=9)
    docs = documents_of(tokens)
    cu, longest = dispatch.cu_seqlens(docs.bounds)
    lengths = [n for row in docs.lengths() for n in row]
    assert cu.tolist() == [0] + np.cumsum(lengths).tolist() and cu.dtype == torch.int32 and longest == max(lengths)


@tk.gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 255])
def test_gpu_document_attention(window, dtype):
    """Real sizes: 2 x 4096 tokens packed with documents of up to 1500, bf16/fp16 against the fp32 reference;
    the blockwise (ring) form too; and the forward visits fewer blocks than the causal triangle."""
    tokens = packed_tokens(2, 4096, seed=10, longest=1500)
    bounds = documents_of(tokens).bounds.cuda()
    q, k, v = (t.to(dtype) for t in qkv(2, 4096, 8, 2, 128, device="cuda"))
    fa = tk._tk("flash_triton")
    with fa.counting() as visits:
        _, lse = fa.forward(q, k, v, True, None, window, doc_bounds=bounds)
    with fa.counting() as causal:
        fa.forward(q, k, v, True, None, window)
    assert visits["forward"] < causal["forward"]
    assert tk._rel_err(lse, reference.attention_lse(q, k, window=window, doc_bounds=bounds)) < 1e-3
    tk._compare(lambda *t: dispatch.attention(*t, backend="triton", window=window, doc_bounds=bounds),
                lambda *t: reference.attention(*t, window=window, doc_bounds=bounds), [q, k, v], tol=2e-2)
    _, do, grads, _ = _blockwise(q, k, v, window, bounds, "triton")
    ref = [tk._leaf(t.float()) for t in (q, k, v)]
    reference.attention(*ref, window=window, doc_bounds=bounds).backward(do.float())
    assert all(tk._rel_err(g, r.grad) < 2e-2 for g, r in zip(grads, ref))


@tk.gpu_test
def test_gpu_rope_per_sample_angles():
    tokens = packed_tokens(2, 2048, seed=11, longest=700)
    ids, _ = Packing(EOD, reset_position_ids=True).apply(tokens)
    x = torch.randn(2048, 2, 32, 128, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    freqs = (ids.t().float().unsqueeze(-1) * 10000.0 ** (-torch.arange(0, 128, 2) / 128)).cuda()
    tk._compare(dispatch.apply_rope, reference.apply_rope, [x, freqs], tol=1e-2, constant=(1,))


# ---------------------------------------------------------------- FLOPs and the planner


def _model(**kw) -> ModelConfig:
    return ModelConfig(**{"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 64,
                          "vocab_size": 64} | NO_DROPOUT | kw)


def test_flops_count_the_sum_of_squared_document_lengths():
    m, s = _model(), 4096
    per_layer = 4 * m.num_attention_heads * m.head_dim()
    assert flops.attention_pairs(m, [s]) == 4 * s * s  # one whole sequence: the formula's s^2 per layer
    assert flops.attention_pairs(m, [1000, 3000, 96]) == 4 * (1000 ** 2 + 3000 ** 2 + 96 ** 2)
    windowed = _model(window_size="511,0", window_attn_skip_freq="2")  # layers 0, 2 windowed; 1, 3 full
    assert flops.attention_pairs(windowed, [1000, 96]) == 2 * (1000 * 512 + 96 * 96) + 2 * (1000 ** 2 + 96 ** 2)
    pairs = 8 * flops.attention_pairs(m, [1000, 3000, 96])  # a step of 8 such samples
    packed, whole = flops.flops_per_iteration(m, 8, s, pairs=pairs), flops.flops_per_iteration(m, 8, s)
    assert whole - packed == 3 * per_layer * 8 * 4 * (s * s - 1000 ** 2 - 3000 ** 2 - 96 ** 2)
    assert flops.flops_per_iteration(m, 8, s, pairs=8 * flops.attention_pairs(m, [s])) == whole
    full = flops.flops_per_iteration(m, 8, s, "full", pairs=pairs)  # the recomputed forward: its documents too
    assert full - packed == 8 * flops.forward_flops_per_sequence(m, s)["linear"] + per_layer * pairs


def test_the_planner_counts_packed_documents_of_a_mean_length():
    """--mean-document-length L: samples of s tokens hold s / L documents of L (the last what is left): the
    planner's FLOPs and attention time equal the sum of L_i^2 counting of such a batch."""
    m, s, L, gpu = _model(seq_length=4096), 4096, 1000, GPU_PRESETS["h100-sxm"]
    assert packed_lengths(s, L) == [1000] * 4 + [96] and packed_lengths(s, None) == [s] == packed_lengths(s, 8192)
    assert mean_keys_per_query(m, s, L) == (4 * 1000 ** 2 + 96 ** 2) / s
    seconds = lambda sw: _attention_seconds(m, Layout(), s, gpu, sw)[0]  # noqa: E731
    assert seconds(Software(document_length=L)) == pytest.approx(seconds(Software()) * (4 * 1000 ** 2 + 96 ** 2)
                                                                 / s ** 2)
    layout = Layout(dp=8)
    packed = estimate(m, layout, gpu, 64, s, software=Software(document_length=L))
    whole = estimate(m, layout, gpu, 64, s)
    counted = flops.flops_per_iteration(m, 64, s, pairs=64 * flops.attention_pairs(m, [1000] * 4 + [96]))
    assert packed.tflops_per_gpu * packed.step_time_s * 8 * 1e12 == pytest.approx(counted, rel=1e-12)
    assert packed.step_time_s < whole.step_time_s


def test_find_parallelism_takes_a_mean_document_length(capsys, monkeypatch):
    from planner_common import run_cli
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = ["--config", "configs/llama3-8b-128k.yaml", "--num-gpus", "64", "--tp", "8", "--cp", "4", "--pp", "1",
            "--tokens", "1e12"]
    rows = {}
    for extra in ([], ["--mean-document-length", "4096"]):
        assert run_cli(*argv, *extra, "--json") == 0
        rows[bool(extra)] = json.loads(capsys.readouterr().out)[0]
    assert rows[True]["step_time_s"] < rows[False]["step_time_s"]  # the kernels skip other documents' blocks
    assert rows[True]["plan"]["training_flops"] < rows[False]["plan"]["training_flops"]
    assert run_cli(*argv, "--mean-document-length", "4096") == 0
    assert "--reset-attention-mask" in capsys.readouterr().out  # the command it prints
    assert run_cli(*argv, "--mean-document-length", "0") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("find_parallelism.py: error: --mean-document-length 0: give")


# The README's table (context parallelism with packed documents): the busiest CP rank's attention work over the
# mean rank's, the median over 20 samples of 8192 tokens packed with documents of 1 to N tokens (uniform).
LOAD_BALANCE = {(1024, 2): 1.07, (1024, 4): 1.23, (1024, 8): 1.44, (8192, 2): 1.25, (8192, 4): 1.33, (8192, 8): 1.42}


def test_the_load_balance_of_the_sample_split_under_documents():
    """The 2cp-chunk split balances causal work exactly; with packed documents a rank's work is its queries'
    document keys, which depends on where documents begin: the README's figures."""
    s, measured = 8192, {}
    for longest, cp in LOAD_BALANCE:
        chunk, ratios = s // (2 * cp), []
        for seed in range(20):
            mask = AttentionMask().within(documents_of(packed_tokens(1, s, seed=100 + seed, longest=longest)))
            work = [sum(mask.pairs(range(c * chunk, (c + 1) * chunk), range(0, s))
                        for c in context_split.chunk_ids(cp, r)) for r in range(cp)]
            ratios.append(max(work) * cp / sum(work))
        measured[longest, cp] = round(float(np.median(ratios)), 2)
    assert measured == LOAD_BALANCE
    causal = [sum(AttentionMask().pairs(range(c * 512, (c + 1) * 512), range(0, s)) for c in context_split.chunk_ids(8, r))
              for r in range(8)]
    assert max(causal) == min(causal)  # one document per sample: exactly balanced


# ---------------------------------------------------------------- flags, data and the picture


def test_packed_document_flags_are_megatrons_and_their_mistakes_one_line(tmp_path):
    cfg = parse_config(["--config", "configs/gpt-tiny.yaml", "--mock-data", "--reset-attention-mask",
                        "--reset-position-ids", "--eod-mask-loss"])
    assert cfg.data.reset_attention_mask and cfg.data.reset_position_ids and not cfg.notices
    for flag in ("--reset-attention-mask", "--reset-position-ids"):
        with pytest.raises(ConfigError) as e:
            validate(parse_config(["--config", "configs/gpt-tiny.yaml", "--mock-data", flag]), 1)
        assert str(e.value) == f"{flag} with --mock-data: synthetic tokens have no end-of-document token; drop one " \
                               "of them"
    prefix = str(tmp_path / "noeod")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for n in (5, 9, 3):
        writer.add_document(np.arange(n) + 1)  # made without --append-eod
    writer.finalize()
    argv = ["--config", "configs/gpt-tiny.yaml", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--reset-attention-mask"]
    with pytest.raises(ConfigError) as e:
        validate(parse_config(argv), 1)
    assert str(e.value).startswith(f"--reset-attention-mask: no document of {prefix} ends with the end-of-document "
                                   "token 100") and "--append-eod" in str(e.value) and "\n" not in str(e.value)
    bare = Config()
    bare.data.reset_position_ids, bare.data.data_path = True, [prefix]
    from engine.data.build import end_of_document
    with pytest.raises(ConfigError, match="^--reset-position-ids: the run names no tokenizer with an end-of-document"):
        end_of_document(bare)


def test_packed_samples_keep_their_documents_as_megatrons_dataset_masks_them(tmp_path):
    """Documents written with an EOD at their end (tools/preprocess_data.py --append-eod) and packed into samples
    by the GPTDataset: the door's position ids, mask and (--eod-mask-loss) loss mask of every sample equal
    megatron-core's GPTDataset items built with reset_position_ids, reset_attention_mask and eod_mask_loss."""
    import test_megatron_data as md
    from engine.data.batch import make_batch
    _, builder, gpt_dataset, gpt_config = md.megatron()
    prefix = md.write(str(tmp_path / "corpus"), 200, seed=4)
    cfg = gpt_config(random_seed=md.SEED, sequence_length=md.SEQ, blend=([prefix], None), split="100,0,0",
                     tokenizer=md._Tokenizer(), reset_position_ids=True, reset_attention_mask=True,
                     eod_mask_loss=True, create_attention_mask=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = builder(gpt_dataset, [300, 0, 0], lambda: True, cfg).build()[0]
    mine = md.ternion_splits([prefix], "100,0,0", [300, 0, 0])[0]
    mine.eod_mask = md.EOD
    packing, positions = Packing(md.EOD, True, True), torch.arange(md.SEQ)
    for i in range(300):
        batch = make_batch(mine, [i])
        ids, docs = packing.apply(batch["tokens"])
        item = theirs[i]
        assert torch.equal(ids[0], item["position_ids"]), i
        assert torch.equal(reference.visible(positions, positions, True, None, docs.bounds)[0], ~item["attention_mask"][0])
        assert torch.equal(batch["loss_mask"][0], item["loss_mask"]), i


def test_plot_mask_draws_one_packed_samples_documents(tmp_path, capsys):
    import plot_mask
    rng, prefix = np.random.default_rng(0), str(tmp_path / "docs")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(200):
        writer.add_document(np.append(rng.integers(0, 100, size=int(rng.integers(2, 60))), 100))
    writer.finalize()
    out, flags = str(tmp_path / "mask.png"), ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert plot_mask.main([prefix, "--sample", "3", "--out", out, *flags]) == 0
    title = capsys.readouterr().out
    tokens, eod = plot_mask.sample_tokens(plot_mask.build_parser().parse_args([prefix, "--sample", "3", "--out", out,
                                                                                *flags]))
    ends = [i for i, t in enumerate(tokens.tolist()[:-1]) if t == eod]
    lengths = np.diff([-1] + ends + [127]).tolist()
    assert eod == 100 and os.path.getsize(out) > 10_000
    assert title.startswith(f"sample 3: {len(lengths)} documents ({', '.join(map(str, lengths))}); attention pairs "
                            f"{sum(n * n for n in lengths):,} of 16,384")
    image, _ = plot_mask.mask_image(tokens, eod, 5)  # a window narrows each document's triangle to a band
    assert (image >= 2).sum() == sum(min(i, 5) + 1 for n in lengths for i in range(n))
    assert plot_mask.main([prefix, "--out", out]) == 2
    assert capsys.readouterr().err.startswith(f"plot_mask.py: {prefix}: give the tokenizer the data was made with")

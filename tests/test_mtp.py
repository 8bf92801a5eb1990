"""Multi-token prediction (engine/mtp.py) on one rank against the rule written out by hand.

Module k reads at position i the token i + k and predicts token i + k + 1; its input is proj([enorm(embedding);
hnorm(previous hidden)]), the previous hidden being the decoder's output through its final norm for k = 1 and
module k - 1's through its own final norm after (megatron-core's rule). The
by-hand version loops over depths with explicit index arithmetic on whole sequences (no targets helper) and a
loss mask; the model's LM loss must be untouched, its gradient that of LM + factor x mean over modules, and the
logged mtp_loss their mean. Budget: about a second.
"""
import torch
import torch.nn.functional as F

from engine.config import Config
from engine.loss import mean_loss
from engine.mtp import MTPStats, targets
from engine.parallel.topology import ParallelContext
from engine.pipeline.partition import build_model_chunks
from engine.pipeline.runner import PipelineRunner

VOCAB, SEQ = 50, 12


def mtp_config(depth=2) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, SEQ
    m.vocab_size, m.make_vocab_size_divisible_by, m.ffn_hidden_size = VOCAB, 16, 48
    m.normalization, m.position_embedding_type, m.swiglu = "RMSNorm", "rope", True
    m.disable_bias_linear, m.untie_embeddings_and_output_weights = True, True
    m.multi_latent_attention, m.qk_layernorm, m.kv_lora_rank = True, True, 16
    m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 12, 8, 10
    m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq = 4, 2, 16, "[0,1]"
    m.moe_router_score_function, m.moe_shared_expert_intermediate_size = "sigmoid", 16
    m.mtp_num_layers, m.mtp_loss_scaling_factor = depth, 0.3
    m.hidden_dropout = m.attention_dropout = 0.0  # the by-hand rule has no dropout
    return cfg


def by_hand(model, tokens, labels, mask):
    """(LM loss, [each module's loss]) of one microbatch, the MTP rule written out."""
    whole = torch.cat((tokens, labels[:, -1:]), dim=1)
    s = tokens.shape[1]
    x = model.embed(tokens, torch.arange(s))
    freqs = model.rope_freqs(torch.arange(s))
    for i in model.layer_ids:
        x = model.layers[str(i)](x, freqs, torch.arange(s))
    h = model.final_norm(x)
    lm = mean_loss(model.head(h, labels), mask)
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        ahead = whole[:, k:k + s]
        ahead = torch.cat((ahead, ahead.new_zeros(ahead.shape[0], s - ahead.shape[1])), dim=1)  # past the end: any
        e = F.embedding(ahead.t(), model.word.weight)
        h = module.proj(torch.cat((module.embedding_norm(e), module.hidden_norm(h)), dim=-1))
        h = module.final_norm(module.layer(h, freqs, torch.arange(s)))
        logits = F.linear(h, model.output)[..., :VOCAB].transpose(0, 1)  # [b, s, V]
        total, count = 0.0, 0.0
        for i in range(s - k):  # position i predicts token i + k + 1 = labels[i + k]
            weight = mask[:, i + k]
            total = total + (F.cross_entropy(logits[:, i], labels[:, i + k], reduction="none") * weight).sum()
            count = count + weight.sum()
        losses.append(total / count)
    return lm, losses


def test_mtp_equals_the_rule_written_out_and_joins_backward_beside_the_lm_loss():
    cfg = mtp_config()
    ctx = ParallelContext.virtual()
    chunks = build_model_chunks(cfg, ctx, vocab_size=VOCAB)
    model = chunks[0].train()
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    tokens, labels = t[:, :-1], t[:, 1:]
    mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}

    lm, losses = by_hand(model, tokens, labels, mask)
    (lm + 0.3 * sum(losses) / 2).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for layer in model.modules():
        if hasattr(layer, "reset_stats"):
            layer.reset_stats()

    runner = PipelineRunner(chunks, ctx, ctx.activation_shape(SEQ, 2, 32), torch.float32, "cpu")
    loss = runner.run([batch])
    assert abs(loss - lm.item()) < 1e-6, "the LM loss is the main head's alone"
    logged = MTPStats(cfg, chunks, ctx, "cpu").finish_step()["mtp_loss"]
    assert abs(logged - sum(x.item() for x in losses) / 2) < 1e-6
    assert all(abs(x.item() - 3.9) < 0.5 for x in losses)
    for name, p in model.named_parameters():
        if name in want:
            assert torch.allclose(p.grad, want[name], atol=1e-6, rtol=1e-5), name
    assert model.mtp[1].proj.weight.grad.abs().sum() > 0 and model.output.grad.abs().sum() > 0


def test_targets_are_the_tokens_ahead_and_count_only_inside_the_sample():
    t = torch.arange(7)[None]  # tokens 0..5, labels 1..6
    out = targets({"tokens": t[:, :-1], "labels": t[:, 1:]}, 2)
    assert out["mtp_tokens"][0, :, 0].tolist() == [1, 2, 3, 4, 5, 6]
    assert out["mtp_labels"][0, :4, 1].tolist() == [3, 4, 5, 6]
    assert out["mtp_mask"][0, :, 0].tolist() == [1, 1, 1, 1, 1, 0]
    assert out["mtp_mask"][0, :, 1].tolist() == [1, 1, 1, 1, 0, 0] and out["mtp_count"].tolist() == [5, 4]

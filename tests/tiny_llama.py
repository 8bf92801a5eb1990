"""The tiny Llama the FP8 and Muon layout tests train, and the layout their cases put it in: one place for both."""
from engine.config import Config, ModelConfig
from harness import NO_DROPOUT


def tiny_llama(num_layers: int, seq: int, vocab: int, moe: bool = False) -> Config:
    """GQA (8 heads, 4 groups, hidden 32), SwiGLU, RMSNorm, RoPE, untied embeddings, no biases, no dropout; with
    `moe`, 4 experts of width 32, top 2, aux-loss coefficient 0.01."""
    cfg = Config()
    cfg.model = ModelConfig(**NO_DROPOUT, num_layers=num_layers, hidden_size=32, num_attention_heads=8,
                            num_query_groups=4, seq_length=seq, vocab_size=vocab, make_vocab_size_divisible_by=8,
                            swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                            disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    if moe:
        m = cfg.model
        m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff = 4, 2, 32, 0.01
    return cfg


def place(cfg: Config, tp=1, pp=1, cp=1, ep=1, vpp=None, strategy="no_shard", sp=True, schedule=None) -> Config:
    """Set the layout of `cfg`: sequence parallelism under tp > 1 unless `sp` is False."""
    par = cfg.parallel
    par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size = tp, pp, cp
    par.virtual_pipeline_model_parallel_size, par.sequence_parallel = vpp, tp > 1 and sp
    par.expert_model_parallel_size, par.data_parallel_sharding_strategy = ep, strategy
    par.pipeline_schedule = schedule
    return cfg

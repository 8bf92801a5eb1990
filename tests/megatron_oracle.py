"""megatron-core 0.16.1 as the oracle of tests/test_megatron_checkpoint.py and tests/test_decoupled_lr.py, run in
processes of its own.

    python tests/megatron_oracle.py SPEC.json

SPEC holds `world` (ranks, spawned here on gloo) and `jobs`, run in order on every rank: `save` builds a tiny
GPT-2-, Llama-, MoE- or DeepSeek-shaped (multi-latent attention, with or without a q latent, and multi-token
prediction modules) megatron-core GPTModel at tp (ep) = world, writes a checkpoint the way Megatron-LM's
save_checkpoint does (torch_dist through dist_checkpointing.save with generate_state_dict's keys, or the legacy
mp_rank_XX/model_optim_rng.pt) and its logits on fixed tokens (each MTP module's too: `<logits>.mtp`);
`load` reads a torch_dist save into a fresh model and writes its logits; `train` trains with megatron-core's
DDP + DistributedOptimizer + OptimizerParamScheduler on an indexed dataset read by megatron-core's GPTDataset
(Megatron-LM's sampler: consecutive samples), saves at `save_at` and writes the losses of the iterations after it;
`groups` writes the LR and weight decay its optimizer param groups and OptimizerParamScheduler give each parameter
(--decoupled-lr); `defaults` writes the defaults of its config dataclasses.

Megatron-LM's training package is not installed (megatron-core is): the checkpoint's common state is assembled
here as megatron/training/checkpointing.py (core_v0.16.1) does. megatron-core runs on the CPU once its CUDA calls
are answered: `torch.cuda.current_device()` is the CPU, streams and events do nothing, and a TorchFunctionMode
turns `device="cuda"` into the CPU and answers `.cuda()`/`.type()` as a CUDA tensor would. Two more for MLA
without Transformer Engine: megatron-core stands in mocks for TE's classes, which MLASelfAttention compares its
linears against (`isinstance`), so they become a class nothing is an instance of; and the local spec's
DotProductAttention does not take the `k_channels` / `v_channels` MLA passes it, so a subclass drops them (its
output width is config.kv_channels x heads: kv_channels is set to v_head_dim). Its arithmetic is the local
spec's own. That patching lives in these processes only, never in the test process or the harness's pool.
"""
import argparse
import contextlib
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            kind = func(*args)
            return kind if kind.startswith("torch.cuda") else kind.replace("torch.", "torch.cuda.", 1)
        if name == "to":
            args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _Nothing:
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: _Nothing()


def patch_cuda():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = torch.cuda.Event = _Nothing
    torch.cuda.current_stream = lambda *a, **k: _Nothing()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as moe_utils
    fs_async._process_memory = lambda: 0  # psutil is not installed
    gg.assert_grouped_gemm_is_available = lambda: None  # GroupedMLP is built (and saved), never run
    moe_utils.te_general_gemm = None  # the router's GEMM without Transformer Engine
    import megatron.core.transformer.multi_latent_attention as mla
    mla.TELinear = mla.TEColumnParallelLinear = type("NotTransformerEngine", (), {})
    _CudaOnCpu().__enter__()


def mla_core_attention():
    """The local spec's DotProductAttention, taking (and dropping) the channel counts MLA passes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            assert v_channels in (None, self.config.kv_channels), (v_channels, self.config.kv_channels)
    return MLACoreAttention


SHAPES = {
    "gpt": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, normalization="LayerNorm",
                add_bias_linear=True, position="learned_absolute", swiglu=False, tied=True, groups=None),
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=96, normalization="RMSNorm",
                  add_bias_linear=False, position="rope", swiglu=True, tied=False, groups=2),
    "moe": dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=96, normalization="RMSNorm",
                add_bias_linear=False, position="rope", swiglu=True, tied=False, groups=2, experts=4, topk=2,
                moe_ffn=32, mtp=1),
    # DeepSeek-V3's attention: a q latent, latent norms, YaRN with both mscales (the RoPE channels' factor is
    # their ratio, the softmax's the second squared); two MTP modules
    "mla": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
                add_bias_linear=False, position="rope", swiglu=True, tied=False, groups=None, mtp=2,
                mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                         qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
                         mscale_all_dim=0.5)),
    # DeepSeek-V2-Lite's: one q projection; here plain RoPE, no latent norms, values narrower than q and k
    "mla-noq": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
                    add_bias_linear=False, position="rope", swiglu=True, tied=True, groups=None,
                    mla=dict(q_lora_rank=None, kv_lora_rank=24, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=16,
                             qk_layernorm=False, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0,
                             mscale_all_dim=0.0)),
}
VOCAB, PADDED, SEQ = 250, 256, 32


def transformer_config(shape: dict, tp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
              num_attention_heads=shape["num_attention_heads"], ffn_hidden_size=shape["ffn_hidden_size"],
              num_query_groups=shape["groups"], normalization=shape["normalization"],
              add_bias_linear=shape["add_bias_linear"], gated_linear_unit=shape["swiglu"],
              activation_func=torch.nn.functional.silu if shape["swiglu"] else torch.nn.functional.gelu,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, use_cpu_initialization=True,
              params_dtype=torch.float32, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
              sequence_parallel=False, bias_activation_fusion=False, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    if shape.get("experts"):
        kw.update(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["moe_ffn"],
                  moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
    kw.update(mtp_num_layers=shape.get("mtp"))
    if shape.get("mla"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        return MLATransformerConfig(**kw, **shape["mla"], kv_channels=shape["mla"]["v_head_dim"])
    return TransformerConfig(**kw)


def megatron_args(shape: dict, tp: int, ep: int, **extra) -> argparse.Namespace:
    """What Megatron-LM's parse_args leaves for this model (the arguments its checkpoints are read by)."""
    from megatron.core.transformer.enums import AttnBackend
    args = dict(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                ffn_hidden_size=shape["ffn_hidden_size"], num_attention_heads=shape["num_attention_heads"],
                group_query_attention=shape["groups"] is not None, num_query_groups=shape["groups"] or 1,
                kv_channels=None, seq_length=SEQ, max_position_embeddings=64, position_embedding_type=shape["position"],
                add_position_embedding=True, use_rotary_position_embeddings=shape["position"] == "rope",
                rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False, normalization=shape["normalization"],
                norm_epsilon=1e-5, swiglu=shape["swiglu"], squared_relu=False, openai_gelu=False,
                add_bias_linear=shape["add_bias_linear"], add_qkv_bias=False,
                untie_embeddings_and_output_weights=not shape["tied"], apply_layernorm_1p=False,
                apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.02, padded_vocab_size=PADDED, vocab_size=None, make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None,
                expert_model_parallel_size=ep, num_experts=shape.get("experts"), moe_router_topk=shape.get("topk", 2),
                moe_ffn_hidden_size=shape.get("moe_ffn"), moe_grouped_gemm=bool(shape.get("experts")),
                moe_aux_loss_coeff=0.0, moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
                lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=None,
                lr_warmup_init=0.0, lr_warmup_fraction=None, train_iters=20, micro_batch_size=2, global_batch_size=4,
                weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, seed=1234,
                bf16=False, fp16=False, params_dtype=torch.float32, transformer_impl="local", ckpt_format="torch_dist",
                use_distributed_optimizer=False, fp8=None, multi_latent_attention=False, mtp_num_layers=None,
                attention_backend=AttnBackend.auto, consumed_train_samples=0, consumed_valid_samples=0,
                world_size=tp * ep, data_parallel_size=ep, rampup_batch_size=None, train_samples=None,
                split="100,0,0", tokenizer_type="NullTokenizer", data_path=None)
    args.update(mtp_num_layers=shape.get("mtp"), mtp_loss_scaling_factor=0.1)
    if shape.get("mla"):
        args.update(multi_latent_attention=True, **shape["mla"])
    args.update(extra)
    return argparse.Namespace(**args)


def build(shape_name: str, tp: int, ep: int, seed: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    shape = SHAPES[shape_name]
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(seed)
    config = transformer_config(shape, tp, ep)
    mla = shape.get("mla") or {}
    spec = get_gpt_layer_local_spec(num_experts=shape.get("experts"), moe_grouped_gemm=bool(shape.get("experts")),
                                    normalization=shape["normalization"], moe_use_legacy_grouped_gemm=True,
                                    multi_latent_attention=bool(mla), qk_layernorm=mla.get("qk_layernorm", False))
    if mla:
        spec.submodules.self_attention.submodules.core_attention = mla_core_attention()
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if shape.get("mtp") else None
    model = GPTModel(config, spec, vocab_size=PADDED, max_sequence_length=64, position_embedding_type=shape["position"],
                     share_embeddings_and_output_weights=shape["tied"], mtp_block_spec=mtp)
    with torch.no_grad():  # away from the init: biases and norms must matter
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + len(name))) * 0.05)
    return model, shape


def tokens(n=2, seed=1):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _gathered(out: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel logits [b, s, V/tp] gathered over tp."""
    from megatron.core import parallel_state as ps
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)


def logits(model, x) -> tuple:
    """([b, s, padded vocab] logits, and with MTP modules [D, b, s, padded vocab] theirs, else None). With MTP,
    megatron-core's GPTModel computes losses only (it needs labels: x itself here): the output layer's outputs are
    caught on their way, each MTP module's first, the main head's last (cloned: the loss overwrites them)."""
    positions = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
    mask = torch.triu(torch.ones(x.shape[1], x.shape[1]), 1).bool()[None, None]
    if getattr(model, "mtp_process", False):
        caught = []
        hook = model.output_layer.register_forward_hook(lambda m, i, o: caught.append(o[0].detach().clone()))
        with torch.no_grad():
            model.eval()(x, positions, mask, labels=x)
        hook.remove()
        outs = [_gathered(o.transpose(0, 1)) for o in caught]
        return outs[-1], torch.stack(outs[:-1])
    with torch.no_grad():
        out = model.eval()(x, positions, mask)
    return _gathered(out), None


def common_state(args, iteration: int) -> dict:
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0}


def save_job(rank: int, world: int, job: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    tp, ep = job.get("tp", world), job.get("ep", 1)
    model, shape = build(job["shape"], tp, ep, job.get("seed", 0))
    args = megatron_args(shape, tp, ep, consumed_train_samples=job.get("consumed", 0))
    folder = os.path.join(job["dir"], f"iter_{job['iteration']:07d}")
    if job.get("format", "torch_dist") == "torch_dist":
        os.makedirs(folder, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(common_state(args, job["iteration"]) | {"model": model.sharded_state_dict()}, folder)
    else:
        args.ckpt_format = "torch"
        name = os.path.join(folder, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}", "model_optim_rng.pt")
        if ps.get_data_parallel_rank() == 0:  # Megatron-LM: one copy per model-parallel rank
            os.makedirs(os.path.dirname(name), exist_ok=True)
            torch.save(common_state(args, job["iteration"]) | {"model": model.state_dict_for_save_checkpoint(),
                                                              "opt_param_scheduler": {"num_steps": 0}}, name)
    if "experts" in job:  # each rank's grouped experts: what the conversion must keep in their global order
        dump_experts(model, job["experts"], rank)
    elif "logits" in job:
        out, mtp = logits(model, tokens())
        if rank == 0:
            torch.save(out[..., :VOCAB], job["logits"])
            if mtp is not None:  # the whole padded vocabulary: the MTP loss's softmax runs over it
                torch.save(mtp, f"{job['logits']}.mtp")
    if rank == 0:
        with open(os.path.join(job["dir"], "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(job["iteration"]))
    dist.barrier()


def dump_experts(model, path: str, rank: int) -> None:
    """Layer 0's grouped experts of this rank with its ep rank (their global ids follow from it)."""
    from megatron.core import parallel_state as ps
    experts = model.decoder.layers[0].mlp.experts
    torch.save({"rank": ps.get_expert_model_parallel_rank(), "weight1": experts.weight1.detach(),
                "weight2": experts.weight2.detach()}, f"{path}.{rank}")


def load_job(rank: int, world: int, job: dict) -> None:
    from megatron.core import dist_checkpointing
    model, _ = build(job["shape"], job.get("tp", world), job.get("ep", 1), seed=99)  # the load replaces every weight
    iteration = int(open(os.path.join(job["dir"], "latest_checkpointed_iteration.txt")).read())
    folder = os.path.join(job["dir"], f"iter_{iteration:07d}")
    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
    model.load_state_dict(loaded["model"], strict=False)
    if "experts" in job:
        return dump_experts(model, job["experts"], rank)
    out, mtp = logits(model, tokens())
    if rank == 0:
        torch.save({"logits": out[..., :VOCAB], "mtp": mtp,
                    "args": vars(common["args"]), "iteration": common["iteration"]}, job["logits"])


class _Tokenizer:
    """What megatron-core's GPTDatasetConfig reads from a tokenizer."""
    vocab_size, eod = PADDED, PADDED - 1
    unique_identifiers = {"class": "test-tokenizer"}


def megatron_dataset(prefix: str, samples: int, seed: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, blend=([prefix], None), split="100,0,0",
                           tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, cfg).build()[0]


def train_step(ddp, optimizer, scheduler, batch: list, micro: int) -> float:
    """One iteration as Megatron-LM's train_step runs it at dp 1: each microbatch's mean token loss over the
    microbatches, backward, the DDP grad sync, the optimizer step and the scheduler's advance by the batch."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
    losses = []
    for start in range(0, len(batch), micro):
        items = batch[start:start + micro]
        tokens, labels, loss_mask, positions = (torch.stack([x[k] for x in items])
                                                for k in ("tokens", "labels", "loss_mask", "position_ids"))
        out = ddp(tokens, positions, mask, labels=labels)
        loss = (out.float() * loss_mask).sum() / loss_mask.sum()
        (loss / (len(batch) // micro)).backward()
        losses.append(loss.item())
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    if ok:
        scheduler.step(increment=len(batch))
    return sum(losses) / len(losses)


def save_training(job: dict, model, optimizer, scheduler, args, iteration: int, sharding: str, folder: str) -> None:
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch_dist --use-distributed-optimizer."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    state = common_state(args, iteration) | {"model": model.sharded_state_dict(metadata=metadata)}
    group = ps.get_data_parallel_group(with_context_parallel=True)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata | {"dp_cp_group": group})
    state["opt_param_scheduler"] = scheduler.state_dict()
    os.makedirs(os.path.join(folder, f"iter_{iteration:07d}"), exist_ok=True)
    dist_checkpointing.save(state, os.path.join(folder, f"iter_{iteration:07d}"), content_metadata=metadata)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(iteration))
    dist.barrier()


def train_job(rank: int, world: int, job: dict) -> None:
    """Train `iters` iterations from a fixed init; save at `save_at` in each of `saves` ({sharding type: dir});
    write the losses after it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    tp = job.get("tp", world)
    model, shape = build(job["shape"], tp, 1, job.get("seed", 0))
    T, gbs, mbs, seed = job["iters"], 4, 2, 1234
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=job.get("overlap", False),
        bucket_size=job.get("bucket_size")), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        clip_grad=1.0, use_distributed_optimizer=True, params_dtype=torch.float32), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * gbs,
                                        lr_decay_steps=T * gbs, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=T * gbs, wd_incr_style="constant")
    data = megatron_dataset(job["data"], T * gbs, seed)
    losses = []
    for it in range(1, T + 1):
        losses.append(train_step(ddp, optimizer, scheduler, [data[i] for i in range((it - 1) * gbs, it * gbs)], mbs))
        if it == job["save_at"]:
            args = megatron_args(shape, tp, 1, use_distributed_optimizer=True, train_iters=T, lr_decay_iters=T,
                                 data_path=[job["data"]], consumed_train_samples=it * gbs, seed=seed)
            for sharding, folder in job["saves"].items():
                save_training(job, model, optimizer, scheduler, args, it, sharding, folder)
    if rank == 0:
        torch.save({"losses": losses, "consumed": job["save_at"] * gbs}, job["losses"])


def groups_job(rank: int, world: int, job: dict) -> None:
    """megatron-core's optimizer param groups of the model (_get_param_groups with Megatron-LM's overrides: no
    weight decay on biases and 1-D tensors, --decoupled-lr on the embedding and output layer) and the LR and
    weight decay its OptimizerParamScheduler gives each parameter at each of `positions` (samples)."""
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    model, _ = build(job["shape"], 1, 1, seed=1)
    config = OptimizerConfig(lr=job["lr"], min_lr=job["min_lr"], decoupled_lr=job["decoupled_lr"],
                             decoupled_min_lr=job["decoupled_min_lr"], weight_decay=job["weight_decay"])
    groups = _get_param_groups([model], config, None)
    scheduler = OptimizerParamScheduler(SimpleNamespace(param_groups=groups), init_lr=job["init_lr"],
                                        max_lr=job["lr"], min_lr=job["min_lr"], lr_warmup_steps=job["warmup"],
                                        lr_decay_steps=job["decay"], lr_decay_style=job["style"],
                                        start_wd=job["weight_decay"], end_wd=job["weight_decay"],
                                        wd_incr_steps=job["decay"], wd_incr_style="constant")
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    names = {name: group_of[id(p)] for name, p in model.named_parameters()}
    rates = []
    for position in job["positions"]:
        scheduler.num_steps = 0
        scheduler.step(position)
        rates.append([(g["lr"], g["weight_decay"]) for g in groups])
    if rank == 0:
        json.dump({name: [rates[k][i] for k in range(len(rates))] for name, i in names.items()}, open(job["out"], "w"))


def defaults_job(rank: int, world: int, job: dict) -> None:
    """The defaults of megatron-core's config dataclasses (the model's, the optimizer's, DDP's), by field name."""
    import dataclasses
    import enum

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    out = {}
    for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        for f in dataclasses.fields(cls):
            value = f.default.name if isinstance(f.default, enum.Enum) else f.default
            if value is not dataclasses.MISSING and isinstance(value, (bool, int, float, str, type(None))):
                out.setdefault(f.name, value)
    if rank == 0:
        json.dump(out, open(job["out"], "w"))


def main_rank(rank: int, world: int, spec: dict, port: int) -> None:
    patch_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    jobs = {"save": save_job, "load": load_job, "train": train_job, "groups": groups_job, "defaults": defaults_job}
    from megatron.core import parallel_state as ps
    for phase in phases(spec):
        for job in phase:
            jobs[job["op"]](rank, world, job)
            ps.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def phases(spec: dict):
    """The spec's jobs, then (with `next`) the jobs the test writes into that file once `ready` exists: one
    process start (megatron-core's import, seconds) serves the saves and the loads of what was made of them."""
    yield spec["jobs"]
    if "next" in spec:
        if dist.get_rank() == 0:
            open(spec["ready"], "w").close()
        deadline = time.monotonic() + spec.get("wait", 600)
        while not os.path.exists(spec["next"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the test renames the file into place: it is whole
        yield json.load(open(spec["next"])) if os.path.exists(spec["next"]) else []


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if spec["world"] == 1:
        main_rank(0, 1, spec, port)
    else:
        mp.spawn(main_rank, args=(spec["world"], spec, port), nprocs=spec["world"])

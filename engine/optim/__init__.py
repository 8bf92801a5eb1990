"""Data-parallel gradient reduction and the optimizer: grad buffer, (distributed) AdamW or Muon, loss scaling,
clipping and the LR schedule.

Trainer use, per iteration:
    opt.start_step(num_microbatches)
    for each microbatch: backward of opt.scale_loss(loss / num_microbatches)   (the schedule's job)
    opt.finish_grad_sync()
    result = opt.step(lr_at(iteration, cfg.optim, cfg.training.train_iters))
"""
from engine.optim.grad_buffer import DEFAULT_BUCKET_NUMEL, GradBuffer
from engine.optim.loss_scaler import LossScaler
from engine.optim.optimizer import Optimizer, StepResult, param_names
from engine.optim.schedule import lr_at


def build_optimizer(cfg, model_chunks: list, ctx, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> Optimizer:
    """The optimizer for these model chunks (their parameters get `main_grad` and grad hooks)."""
    return Optimizer(cfg, list(model_chunks), ctx, bucket_numel=bucket_numel)


__all__ = ["build_optimizer", "Optimizer", "StepResult", "GradBuffer", "LossScaler", "param_names", "lr_at"]

"""The global batch size as training goes: fixed, or ramped up as Megatron-LM's --rampup-batch-size does.

`--rampup-batch-size START INCR SAMPLES`: the global batch starts at START and grows by INCR every
SAMPLES / num_increments consumed samples until it reaches --global-batch-size, with num_increments =
(global - START) / INCR. The size is a function of the samples consumed so far, so a run resumed from
its consumed-sample count (or moved forward by a rollback that skips data) takes the same sizes.

This is the one definition: the trainer's step size, the sampler, the dataset sizes, the data-phase
positions and the learning-rate position all read it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizeSchedule:
    start: int
    increment: int
    samples: int
    final: int

    @classmethod
    def fixed(cls, global_batch_size: int) -> "BatchSizeSchedule":
        return cls(global_batch_size, 0, 0, global_batch_size)

    @classmethod
    def from_config(cls, training) -> "BatchSizeSchedule":
        """From a resolved TrainingConfig (engine.resolve.resolve fills --global-batch-size)."""
        if training.global_batch_size is None:
            raise ValueError("the global batch size is not resolved yet: call engine.resolve.resolve(cfg, world_size)")
        if not training.rampup_batch_size:
            return cls.fixed(training.global_batch_size)
        return cls(*training.rampup_batch_size, training.global_batch_size)

    @property
    def ramping(self) -> bool:
        return self.start < self.final

    def at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples` samples."""
        increments = (self.final - self.start) // self.increment if self.increment else 0
        if increments <= 0 or self.samples <= 0 or consumed_samples > self.samples:
            return self.final
        steps = int(consumed_samples / (self.samples / increments))
        return min(self.start + steps * self.increment, self.final)

    def samples_before(self, iteration: int) -> int:
        """Samples consumed by iterations [0, iteration) of an uninterrupted run."""
        consumed = 0
        for done in range(iteration):
            size = self.at(consumed)
            if size == self.final:  # the ramp is over: the rest is arithmetic
                return consumed + (iteration - done) * self.final
            consumed += size
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Iterations of a --train-samples run under this ramp-up, as Megatron-LM's update_train_iters counts
        them: step through the ramp (its last step may pass --train-samples), then whole final batches."""
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.at(consumed)
            iterations += 1
        return iterations + max(train_samples - consumed, 0) // self.final

    def lr_samples(self, consumed_samples: int, iteration: int) -> int:
        """Where the LR schedule stands in Megatron-LM's unit, samples: those consumed while ramping, else
        iteration x the batch size (the same in a run without spike rollbacks, which skip data; the
        schedule then follows the iteration)."""
        return consumed_samples if self.ramping else iteration * self.final

    def lr_position(self, consumed_samples: int, iteration: int) -> float:
        """The same in iterations (engine.optim.lr_at's unit): samples over the final batch size while ramping
        (Megatron-LM counts warm-up and decay that way under ramp-up), else the iteration count."""
        return consumed_samples / self.final if self.ramping else iteration

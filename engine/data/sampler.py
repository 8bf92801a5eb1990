"""Which global samples each data-parallel rank reads at each iteration; resumable from one number.

Iteration t takes the next G(t) samples of the dataset, [consumed, consumed + G(t)), where consumed is
the sum of the earlier global batch sizes. Data-parallel rank r reads the r-th contiguous slice of
G(t) / dp samples, cut into microbatches. The only state is `consumed_samples`: a run resumed with the
count it checkpointed reads exactly the batches an uninterrupted run would have read.
G may be a fixed size or a function of the iteration (batch-size ramp-up).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Union

BatchSize = Union[int, Callable[[int], int]]


def _size_fn(global_batch_size: BatchSize) -> Callable[[int], int]:
    return global_batch_size if callable(global_batch_size) else (lambda _it: global_batch_size)


def samples_before(iteration: int, global_batch_size: BatchSize) -> int:
    """Samples consumed by iterations [0, iteration)."""
    if not callable(global_batch_size):
        return iteration * global_batch_size
    return sum(global_batch_size(t) for t in range(iteration))


class RampupBatchSize:
    """Megatron-LM's --rampup-batch-size START INCR SAMPLES as a function of the iteration.

    The size as a function of consumed samples is engine.optim.schedule.RampupBatchSize's (one
    definition for the sampler, the accumulation steps and the LR); here it is unrolled per iteration.
    """

    def __init__(self, start: int, increment: int, ramp_samples: int, global_batch_size: int):
        from engine.optim.schedule import RampupBatchSize as SampleRamp  # imported late: it loads torch
        by_samples = SampleRamp(start, increment, ramp_samples, global_batch_size)
        self.final = global_batch_size
        self.ramp: list[int] = []  # sizes of the iterations before the final size is reached
        consumed, size = 0, by_samples.global_batch_size_at(0)
        while size < global_batch_size:
            self.ramp.append(size)
            consumed += size
            size = by_samples.global_batch_size_at(consumed)

    def __call__(self, iteration: int) -> int:
        return self.ramp[iteration] if iteration < len(self.ramp) else self.final


def rank_microbatches(start: int, size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list:
    """Global batch [start, start + size): dp rank r's contiguous slice, cut into microbatches of indices."""
    local = size // dp_size
    first = start + dp_rank * local
    return [list(range(first + m, first + m + micro_batch_size)) for m in range(0, local, micro_batch_size)]


class BatchSampler:
    """Yields, per iteration, this rank's microbatches: lists of global sample indices.

    `total_samples` (optional) ends the iteration before a batch that would run past it.
    """

    def __init__(self, consumed_samples: int, global_batch_size: BatchSize, micro_batch_size: int,
                 dp_rank: int, dp_size: int, total_samples: Optional[int] = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.size = _size_fn(global_batch_size)
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.iteration = self._iteration_of(consumed_samples)

    def _iteration_of(self, consumed: int) -> int:
        iteration = seen = 0
        while seen < consumed:
            seen += self.size(iteration)
            iteration += 1
        if seen != consumed:
            raise ValueError(f"consumed_samples {consumed} does not fall between two global batches "
                             f"(the batch sizes give {seen - self.size(iteration - 1)} or {seen})")
        return iteration

    def __iter__(self) -> Iterator[list[list[int]]]:
        return self

    def __next__(self) -> list[list[int]]:
        size = self.size(self.iteration)
        per_rank = self.micro_batch_size * self.dp_size
        if size % per_rank:
            raise ValueError(f"global batch size {size} at iteration {self.iteration} is not a multiple of "
                             f"micro_batch_size {self.micro_batch_size} x dp {self.dp_size}")
        if self.total_samples is not None and self.consumed_samples + size > self.total_samples:
            raise StopIteration
        batch = rank_microbatches(self.consumed_samples, size, self.micro_batch_size, self.dp_rank, self.dp_size)
        self.consumed_samples += size
        self.iteration += 1
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

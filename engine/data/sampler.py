"""Which global samples each data-parallel rank reads at each iteration; resumable from one number.

An iteration takes the next G samples of the dataset, [consumed, consumed + G), where G is the batch-size
schedule's size at `consumed` (engine.data.rampup). They are dealt as Megatron-LM's
MegatronPretrainingSampler deals them: the samples go by in rounds of micro_batch_size x dp, and in each
round data-parallel rank r takes the r-th micro_batch_size of them as its next microbatch. So microbatch
m of rank r is [start + (m x dp + r) x mbs, + mbs): a Megatron run and a Ternion run with the same
layout give every rank the same samples in the same microbatches, ramp-up included (a global batch is a
whole number of rounds). The only state is `consumed_samples`: a run resumed with the count it
checkpointed reads exactly the batches an uninterrupted run would have read, and a rollback that skips
data just moves it forward.
"""
from __future__ import annotations

from engine.data.rampup import BatchSizeSchedule


def rank_microbatches(start: int, size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list:
    """Global batch [start, start + size): dp rank r's microbatches of indices, Megatron-LM's way -- in each
    round of micro_batch_size x dp samples, the r-th micro_batch_size."""
    first = start + dp_rank * micro_batch_size
    stride = micro_batch_size * dp_size
    return [list(range(first + m, first + m + micro_batch_size)) for m in range(0, size, stride)]


class BatchSampler:
    """`next(sampler)`: this rank's microbatches (lists of global sample indices) of the next global batch."""

    def __init__(self, schedule: BatchSizeSchedule, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.schedule, self.micro_batch_size, self.dp_rank, self.dp_size = schedule, micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples

    @property
    def batch_size(self) -> int:
        """The size of the next global batch."""
        return self.schedule.at(self.consumed_samples)

    def __iter__(self):
        return self

    def __next__(self) -> list:
        size = self.batch_size
        if size % (self.micro_batch_size * self.dp_size):
            raise ValueError(f"global batch size {size} at {self.consumed_samples} consumed samples is not a multiple "
                             f"of micro_batch_size {self.micro_batch_size} x dp {self.dp_size}")
        batch = self.microbatches_of(self.consumed_samples, size)
        self.consumed_samples += size
        return batch

    def microbatches_of(self, start: int, size: int) -> list:
        """This rank's microbatches of the global batch [start, start + size), leaving the position alone
        (evaluation reads fixed windows of the validation split this way)."""
        return rank_microbatches(start, size, self.micro_batch_size, self.dp_rank, self.dp_size)

    def state_dict(self) -> dict:
        """The checkpoint's "data" entry."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])

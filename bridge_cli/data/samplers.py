"""Batch samplers that hand each data-parallel rank its slice of every global batch.

They start at ``consumed_samples``, so a resumed run reads exactly the samples the interrupted one
had not reached. Same contract as Megatron-LM's pretraining samplers.
"""

from __future__ import annotations

from typing import Iterator

import torch


class SequentialBatchSampler:
    """`dataloader_type=single`: one pass over the dataset in order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.start = data_parallel_rank * micro_batch_size
        self.stride = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.stride

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.consumed_samples, self.total_samples - self.stride + 1, self.stride):
            yield list(range(first + self.start, first + self.start + self.micro_batch_size))


class CyclicBatchSampler:
    """`dataloader_type=cyclic`: endless epochs, each a fresh seeded shuffle of the dataset."""

    def __init__(self, dataset_size: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int):
        self.dataset_size = dataset_size
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.stride = micro_batch_size * data_parallel_size
        self.seed = seed

    def __iter__(self) -> Iterator[list[int]]:
        usable = self.dataset_size - self.dataset_size % self.stride
        epoch, offset = divmod(self.consumed_samples, usable)
        while True:
            order = torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + epoch))
            for first in range(offset, usable, self.stride):
                start = first + self.rank * self.micro_batch_size
                yield order[start:start + self.micro_batch_size].tolist()
            epoch, offset = epoch + 1, 0

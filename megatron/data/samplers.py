"""The pretraining sampler: sequential sample numbers from `consumed_samples`, sliced per DP rank.

Each global step consumes `global_batch_size` samples. The sampler walks the sample numbers in
order in blocks of micro_batch_size x DP; every block is one micro batch on each DP rank, rank r
taking [r * micro, (r + 1) * micro) of it. Resuming with consumed_samples = k therefore yields
exactly what an uninterrupted sampler yields after k samples.
"""

from __future__ import annotations

from collections.abc import Iterator


class MegatronPretrainingSampler:
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} is outside the dataset "
                f"(0..{total_samples}); the checkpoint does not match this data"
            )
        if micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError("need micro_batch_size >= 1 and 0 <= data_parallel_rank < DP size")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.dp = data_parallel_rank, data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self, block: list[int]) -> list[int]:
        return block[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        block_size = self.micro_batch_size * self.dp
        block: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            block.append(idx)
            if len(block) == block_size:
                yield self._slice(block)
                block = []
        if block and not self.drop_last:
            tail = self._slice(block)
            if tail:
                yield tail

"""How many micro batches make the global batch, optionally ramping the batch size up.

With `--rampup-batch-size START INCREMENT SAMPLES`, the global batch grows from START by
INCREMENT in equal sample intervals until SAMPLES samples were consumed, then stays at
--global-batch-size (Megatron's ramp).
"""

from __future__ import annotations


class MicroBatchCalculator:
    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup: tuple[int, int, int] | None = None,
    ):
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp, self.rampup = data_parallel_size, rampup

    def global_batch_at(self, consumed_samples: int) -> int:
        if self.rampup is None:
            return self.global_batch_size
        start, incr, samples = self.rampup
        steps = (self.global_batch_size - start) // incr
        if steps == 0 or consumed_samples >= samples:
            return self.global_batch_size
        interval = samples / steps
        return start + incr * int(consumed_samples // interval)

    def num_micro_batches(self, consumed_samples: int) -> int:
        return self.global_batch_at(consumed_samples) // (self.micro_batch_size * self.dp)

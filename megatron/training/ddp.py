"""Data parallelism with fp32 gradient buckets all-reduced during backward.

Every parameter gets `main_grad`, a view into one contiguous fp32 buffer. A hook moves each
fresh `.grad` into it (so gradient accumulation over micro batches happens in fp32 whatever the
model dtype) and frees `.grad`. On the last micro batch, a bucket (a slice of the buffer, filled
in reverse parameter order, roughly the order backward produces gradients) is averaged over the
DP group as soon as its last gradient arrives, overlapping the all-reduce with the rest of
backward. `finish_grad_sync()` waits for all of it before the optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.mpu.utils import group_size


@dataclass
class _Bucket:
    start: int
    end: int
    params: list = field(default_factory=list)
    ready: int = 0
    handle: object | None = None
    launched: bool = False


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        dp_group=None,
        *,
        bucket_size: int = 40_000_000,
        overlap_grad_reduce: bool = True,
        grad_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.module = module
        self.dp_group, self.dp_size = dp_group, group_size(dp_group)
        self.overlap = overlap_grad_reduce and self.dp_size > 1
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.grad_buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=grad_dtype, device=device
        )
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        offset = 0
        for p in reversed(params):
            if not self.buckets or offset - self.buckets[-1].start >= bucket_size:
                self.buckets.append(_Bucket(offset, offset))
            bucket = self.buckets[-1]
            p.main_grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            bucket.end = offset
            bucket.params.append(p)
            self._bucket_of[id(p)] = bucket
            p.register_post_accumulate_grad_hook(self._accumulate)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _accumulate(self, param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.overlap and self.sync_enabled:
            bucket = self._bucket_of[id(param)]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched or self.dp_size == 1:
            return
        view = self.grad_buffer[bucket.start : bucket.end]
        view.div_(self.dp_size)  # sum of averages = the average over the global batch
        bucket.handle = dist.all_reduce(view, group=self.dp_group, async_op=True)
        bucket.launched = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without all-reducing (every micro batch but the last)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Launch the buckets backward did not complete, then wait for every all-reduce."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready, bucket.handle, bucket.launched = 0, None, False

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

"""Data parallelism with fp32 gradient buckets all-reduced during backward.

Every parameter gets `main_grad`, a view into one contiguous fp32 buffer. A hook moves each
fresh `.grad` into it (so gradient accumulation over micro batches happens in fp32 whatever the
model dtype) and frees `.grad`. On the last micro batch, a bucket (a slice of the buffer, filled
in reverse parameter order, roughly the order backward produces gradients) is averaged over the
DP group as soon as its last gradient arrives, overlapping the all-reduce with the rest of
backward. `finish_grad_sync()` waits for all of it before the optimizer step.

`--allreduce-dtype params` (fp16/bf16 weights) casts each bucket to the weights' dtype for the
all-reduce only (half the traffic); accumulation stays fp32. `--DDP-impl torch` wraps the model
chunk in torch.nn.parallel.DistributedDataParallel instead (TorchDistributedDataParallel), with
the same interface, so the schedules and the optimizer do not know which one runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron.config.schema import DistributedConfig
from megatron.mpu.utils import group_size


@dataclass
class _Bucket:
    start: int
    end: int
    params: list = field(default_factory=list)
    ready: int = 0
    handle: object | None = None
    launched: bool = False
    reduced: torch.Tensor | None = None  # the low-precision copy being all-reduced


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        dp_group=None,
        *,
        bucket_size: int = 40_000_000,
        overlap_grad_reduce: bool = True,
        grad_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.reduce_dtype = reduce_dtype or grad_dtype
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
        if self.reduce_dtype != view.dtype:
            bucket.reduced = view.to(self.reduce_dtype)  # copied back in finish_grad_sync
            view = bucket.reduced
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
            if bucket.reduced is not None:
                self.grad_buffer[bucket.start : bucket.end].copy_(bucket.reduced)
                bucket.reduced = None

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready, bucket.handle, bucket.launched = 0, None, False

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


class TorchDistributedDataParallel(nn.Module):
    """--DDP-impl torch: torch's DistributedDataParallel over the one model chunk (PP = 1).

    torch DDP averages `.grad` over the DP group during the last micro batch's backward (its
    `no_sync` holds the earlier ones back, accumulating locally); `finish_grad_sync` then
    moves the averaged `.grad` into the same fp32 `main_grad` views the optimizer reads.
    `module` stays our ModelChunks (state dict, names); the schedules run the forward through
    `forward_chunk`, the torch DDP wrapper, which is what arms its all-reduce hooks.
    """

    def __init__(self, module: nn.Module, dp_group=None, *, bucket_size: int = 40_000_000):
        super().__init__()
        self.module = module
        chunk = module[0] if hasattr(module, "chunks") else module
        self.forward_chunk = torch.nn.parallel.DistributedDataParallel(
            chunk,
            process_group=dp_group,
            bucket_cap_mb=bucket_size * 4 / 2**20,  # fp32 elements -> MiB
            broadcast_buffers=False,  # no buffer changes during training
        )
        self.params = [p for p in module.parameters() if p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_buffer = torch.zeros(
            sum(p.numel() for p in self.params), dtype=torch.float32, device=device
        )
        offset = 0
        for p in self.params:
            p.main_grad = self.grad_buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def forward(self, *args, **kwargs):
        return self.forward_chunk(*args, **kwargs)

    def no_sync(self):
        return self.forward_chunk.no_sync()

    def finish_grad_sync(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


def wrap_data_parallel(model: nn.Module, dp_group, cfg: DistributedConfig, params_dtype):
    """The data-parallel wrapper the flags ask for (--DDP-impl, --allreduce-dtype)."""
    if cfg.ddp_impl == "torch":
        return TorchDistributedDataParallel(model, dp_group, bucket_size=cfg.ddp_bucket_size)
    return DistributedDataParallel(
        model,
        dp_group,
        bucket_size=cfg.ddp_bucket_size,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        reduce_dtype=params_dtype if cfg.allreduce_dtype == "params" else torch.float32,
    )

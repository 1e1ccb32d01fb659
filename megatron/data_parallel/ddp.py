"""Data parallelism with fp32 gradient buckets all-reduced during backward.

Every parameter gets `main_grad`, a view into one contiguous fp32 buffer. A hook moves each
fresh `.grad` into it (so gradient accumulation over micro batches happens in fp32 whatever the
model dtype) and frees `.grad`. On the last micro batch, a bucket (a slice of the buffer, filled
in reverse parameter order, roughly the order backward produces gradients) is averaged over the
DP group as soon as its last gradient arrives, overlapping the all-reduce with the rest of
backward. `finish_grad_sync()` waits for all of it before the optimizer step.

With `use_distributed_optimizer` (megatron.optim.distributed) each bucket is padded to
a multiple of DP and cut into DP equal contiguous shards; the bucket is reduce-scattered instead
of all-reduced, so DP rank r ends with the averaged gradient of shard r of every bucket only
(the rest of the buffer holds this rank's unreduced gradients and must not be read). The
parameters then live in one buffer of the same layout (each `.data` a view into it), so the
shards each rank updates are all-gathered in place, bucket by bucket (`start_param_sync`;
with `overlap_param_gather` the next forward waits per module for the buckets it uses).

Mixture of experts (`expert_group`): the parameters marked `expert_parallel` differ between the
EP ranks of a DP (x CP) group, so they get buckets of their own, reduced over the
expert-data-parallel group (the DP x CP / EP ranks holding the same experts; sharded over it by
the distributed optimizer). Each rank's expert gradient already sums the tokens of its whole EP
group, so every bucket is divided by the full DP (x CP) size: both end as the global batch's
average.

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

from megatron.config.schema_distributed import DistributedConfig
from megatron.mpu.utils import group_rank, group_size

# Shard sizes are multiples of this (elements): aligned shard starts for the collectives.
_SHARD_ALIGN = 64
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _Bucket:
    start: int
    end: int
    group: object | None = None  # reduced over: DP (x CP), or expert-DP for expert buckets
    size: int = 1  # ranks in `group`
    rank: int = 0  # this rank's index in `group`
    params: list = field(default_factory=list)
    ready: int = 0
    handle: object | None = None
    launched: bool = False
    gather: object | None = None  # the pending param all-gather (distributed optimizer)
    reduced: torch.Tensor | None = None  # the low-precision copy being all-reduced

    def shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """[start, end) in the buffers of the shard DP rank `dp_rank` owns (padded buckets)."""
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        dp_group=None,
        *,
        bucket_size: int = 40_000_000,
        overlap_grad_reduce: bool = True,
        grad_dtype: torch.dtype = torch.float32,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        own_bucket: tuple[torch.Tensor, ...] = (),
        reduce_dtype: torch.dtype | None = None,
        expert_group=None,
    ):
        """`own_bucket`: parameters that get a bucket of their own (with the distributed
        optimizer: the tied embedding, so that the first and last stage shard it alike).
        `expert_group`: the group of the `expert_parallel` parameters' buckets (None: dp_group)."""
        super().__init__()
        self.reduce_dtype = reduce_dtype or grad_dtype
        self.module = module
        self.dp_group, self.dp_size = dp_group, group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.expert_group = expert_group if expert_group is not None else dp_group
        self.overlap = overlap_grad_reduce and self.dp_size > 1
        self.distributed = use_distributed_optimizer
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self.param_ranges: list[tuple[nn.Parameter, int, int]] = []  # (param, start, end)
        total = self._lay_out(params, bucket_size, {id(p) for p in own_bucket})
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_buffer = self._param_buffer(params, total, device) if self.distributed else None
        for p, start, end in self.param_ranges:
            p.main_grad = self.grad_buffer[start:end].view_as(p)
            p.register_post_accumulate_grad_hook(self._accumulate)
        if self.distributed and overlap_param_gather and self.dp_size > 1:
            self._hook_forward_waits(own_bucket)

    def _lay_out(self, params: list, bucket_size: int, own: set[int]) -> int:
        """Assign each parameter its buffer range and bucket (reverse order); returns the size."""
        offset, previous_alone = 0, False
        for p in reversed(params):
            alone = id(p) in own and self.distributed
            full = self.buckets and offset - self.buckets[-1].start >= bucket_size
            group = self.expert_group if getattr(p, "expert_parallel", False) else self.dp_group
            other_group = self.buckets and self.buckets[-1].group is not group
            if not self.buckets or full or alone or previous_alone or other_group:
                offset = self._close_bucket(offset)
                self.buckets.append(
                    _Bucket(offset, offset, group, group_size(group), group_rank(group))
                )
            bucket = self.buckets[-1]
            self.param_ranges.append((p, offset, offset + p.numel()))
            offset += p.numel()
            bucket.end = offset
            bucket.params.append(p)
            self._bucket_of[id(p)] = bucket
            previous_alone = alone
        return self._close_bucket(offset)

    def _close_bucket(self, offset: int) -> int:
        """Pad the last bucket to a multiple of its group's size x _SHARD_ALIGN (distributed
        optimizer)."""
        if not self.distributed or not self.buckets:
            return offset
        unit = self.buckets[-1].size * _SHARD_ALIGN
        self.buckets[-1].end = -(-offset // unit) * unit
        return self.buckets[-1].end

    def _param_buffer(self, params: list, total: int, device) -> torch.Tensor:
        """One buffer of the model dtype with the grad buffer's layout; params become views."""
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype, got {dtypes}")
        buffer = torch.zeros(total, dtype=dtypes.pop() if dtypes else torch.float32, device=device)
        with torch.no_grad():
            for p, start, end in self.param_ranges:
                buffer[start:end].copy_(p.detach().reshape(-1))
                p.data = buffer[start:end].view_as(p)
        return buffer

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
        if bucket.size == 1:  # experts at EP = DP: nothing to reduce
            pass
        elif self.distributed:  # in place: this rank's shard of the bucket gets the average
            start, end = bucket.shard(bucket.rank, bucket.size)
            shard = self.grad_buffer[start:end]
            bucket.handle = reduce_scatter(shard, view, group=bucket.group, async_op=True)
        else:
            if self.reduce_dtype != view.dtype:
                bucket.reduced = view.to(self.reduce_dtype)  # copied back in finish_grad_sync
                view = bucket.reduced
            bucket.handle = dist.all_reduce(view, group=bucket.group, async_op=True)
        bucket.launched = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without all-reducing (every micro batch but the last)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def start_grad_sync(self, done: set[int]) -> None:
        """Launch the buckets whose parameters (ids) are all in `done`: a pipeline schedule
        calls it as its model chunks run their last backward or W of the step, so the DP
        reduction of those buckets overlaps the rest of the step (as backward's hooks do without
        pipelining)."""
        if not self.overlap:
            return
        for bucket in self.buckets:
            if not bucket.launched and all(id(p) in done for p in bucket.params):
                self._launch(bucket)

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

    def start_param_sync(self, *, overlap: bool = False) -> None:
        """Distributed optimizer, after each rank updated its shards: all-gather every bucket
        of the parameter buffer in place, in forward order (the last bucket first). Without
        `overlap` wait here; with it the forward pre-hooks (or finish_param_sync) wait."""
        if not self.distributed or self.dp_size == 1:
            return
        for bucket in reversed(self.buckets):
            if bucket.size == 1:
                continue
            start, end = bucket.shard(bucket.rank, bucket.size)
            whole = self.param_buffer[bucket.start : bucket.end]
            bucket.gather = all_gather(
                whole, self.param_buffer[start:end], group=bucket.group, async_op=True
            )
        if not overlap:
            self.finish_param_sync()

    def finish_param_sync(self, params=None) -> None:
        """Wait for the pending all-gathers of the buckets holding `params` (default: all)."""
        buckets = self.buckets if params is None else [self._bucket_of[id(p)] for p in params]
        for bucket in buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def _hook_forward_waits(self, own_bucket) -> None:
        """--overlap-param-gather: a module's forward first waits for its parameters' buckets.
        The last stage's tied embedding belongs to a module that never runs (the head reads
        the weight): each model chunk waits for the `own_bucket` parameters before it starts."""
        shared = [p for p in own_bucket if id(p) in self._bucket_of]
        for chunk in getattr(self.module, "chunks", [self.module]) if shared else []:
            chunk.register_forward_pre_hook(lambda _m, _a: self.finish_param_sync(shared))
        for module in self.module.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self._bucket_of]
            if own:
                module.register_forward_pre_hook(
                    lambda _m, _args, own=own: self.finish_param_sync(own)
                )

    def zero_grad_buffer(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready, bucket.handle, bucket.launched = 0, None, False

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()  # the weights of an overlapped all-gather, complete
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        self.finish_param_sync()  # no all-gather in flight may overwrite what is loaded
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


def wrap_data_parallel(
    model: nn.Module, dp_group, cfg: DistributedConfig, params_dtype, **distributed_optimizer
):
    """The data-parallel wrapper the flags ask for (--DDP-impl, --allreduce-dtype);
    `distributed_optimizer`: the arguments of our DistributedDataParallel for
    --use-distributed-optimizer (the rules refuse it with --DDP-impl torch)."""
    if cfg.ddp_impl == "torch":
        return TorchDistributedDataParallel(model, dp_group, bucket_size=cfg.ddp_bucket_size)
    return DistributedDataParallel(
        model,
        dp_group,
        bucket_size=cfg.ddp_bucket_size,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        reduce_dtype=params_dtype if cfg.allreduce_dtype == "params" else torch.float32,
        **distributed_optimizer,
    )

"""The four tensor-parallel region boundaries, as autograd functions.

All TP communication in a forward pass goes through these. Each names what happens going into
(or out of) a region where tensors are split over the TP group; the backward is the dual
collective. Tensors are batch-first, so "split" is along the last (hidden) dimension.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.utils import divide, group_rank, group_size


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    local = divide(x.size(-1), size)
    return x.narrow(-1, group_rank(group) * local, local).contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce of the gradient over TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) over TP. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather of the last dim over TP. Backward: keep this rank's gradient chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group)

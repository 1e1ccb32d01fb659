"""The tensor-parallel region boundaries, as autograd functions.

All TP communication in a forward pass goes through these. Each names what happens going into
(or out of) a region where tensors are split over the TP group; the backward is the dual
collective. Tensors are batch-first (b, s, h): the four TP mappings split the last (hidden)
dimension; the three sequence-parallel ones (--sequence-parallel) split the sequence, dim 1,
between the TP regions (norms, dropout, residuals), so each TP rank holds s / p tokens there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.overlap import hand_over
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


# ---- sequence parallelism: activations split along dim 1 (the sequence) over TP ----

SEQUENCE_DIM = 1  # activations are (b, s, h)


def sequence_slice(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This TP rank's contiguous s / p positions of `x` along `dim` (no autograd, no copy of
    the rest): rank r holds positions [r s/p, (r + 1) s/p)."""
    size = group_size(group)
    if size == 1:
        return x
    local = divide(x.size(dim), size)
    return x.narrow(dim, group_rank(group) * local, local)


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/p, h) on each rank -> (b, s, h), rank order (no autograd: for autograd functions
    that do their own backward, such as the sequence-parallel column-parallel linear)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)  # (b, s, h) from p x (b, s/p, h)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) on each rank -> this rank's s / p positions of the sum over ranks (no
    autograd)."""
    size = group_size(group)
    if size == 1:
        return x
    divide(x.size(SEQUENCE_DIM), size)  # raises on a sequence the TP group cannot split
    chunks = [c.contiguous() for c in torch.chunk(x, size, dim=SEQUENCE_DIM)]
    out = torch.empty_like(chunks[0])  # (b, s/p, h)
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Forward: keep this rank's s / p positions. Backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_slice(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Forward: all-gather of the sequence over TP. Backward: reduce-scatter of the gradient
    when the consumer is TP-split (each rank's gradient is a partial sum over its shard), else
    this rank's slice of it (the consumer was replicated, the gradients already agree)."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return sequence_slice(grad, ctx.group).contiguous(), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Forward: sum over TP, each rank keeping its s / p positions. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, grad_is_partial: bool = True
) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, group)


# ---- expert parallelism: tokens (n, h) exchanged along dim 0 over the EP group ----


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]):
    """Launched asynchronously, then the turn handed to the other micro batch of an overlapped
    pair (megatron.mpu.overlap: DualPipeV), which computes while the tokens travel; waited."""
    out, x = x.new_empty((sum(output_splits), *x.shape[1:])), x.contiguous()
    work = dist.all_to_all_single(
        out,
        x,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=True,
    )
    hand_over()  # a no-op outside a pair
    work.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rows [sum(input_splits[:j]), +input_splits[j]) go to EP rank j, and rank j's
    rows for this rank arrive in rank order (output_splits). Backward: the reverse all-to-all.
    Both are hand-over points of an overlapped forward / backward pair (megatron.mpu.overlap)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """(p x n,) counts, slice j for rank j -> (p, n): row j what rank j sent here (no autograd;
    the split sizes of the all-to-all that follows)."""
    size = group_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(size, -1)


def all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]):
    """(sum(input_splits), ...) -> (sum(output_splits), ...): the token exchange of the MoE
    alltoall dispatcher (identity for a group of one)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    chunks = [c.contiguous() for c in torch.chunk(x, group_size(group), dim=0)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather of dim 0 (equal sizes, rank order). Backward: reduce-scatter (each
    rank's gradient of the gathered rows is a partial sum over the experts it holds)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: sum over the group, each rank keeping its 1/p of dim 0. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group), None


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x stacked along dim 0 in rank order (no autograd: routing decisions)."""
    return x if group_size(group) == 1 else _gather_rows(x, group)


def gather_from_expert_region(x: torch.Tensor, group) -> torch.Tensor:
    """Every EP rank's tokens on every EP rank (the MoE allgather dispatcher)."""
    return x if group_size(group) == 1 else _GatherRows.apply(x, group)


def reduce_scatter_to_expert_region(x: torch.Tensor, group) -> torch.Tensor:
    """The experts' partial outputs of all EP ranks' tokens, summed, back to their owners."""
    return x if group_size(group) == 1 else _ReduceScatterRows.apply(x, group)

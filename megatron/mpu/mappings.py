"""The tensor-parallel region boundaries, as autograd functions.

All TP communication in a forward pass goes through these. Each names what happens going into
(or out of) a region where tensors are split over the TP group; the backward is the dual
collective. Tensors are batch-first (b, s, h): the four TP mappings split the last (hidden)
dimension; the three sequence-parallel ones (--sequence-parallel) split the sequence, dim 1,
between the TP regions (norms, dropout, residuals), so each TP rank holds s / p tokens there.
The expert-parallel ones exchange tokens (rows, dim 0) over the EP group. Nothing here reads a
mode: the MoE token all-to-all takes the hook it calls while in flight as an argument (the
MoE layer's `hand_over`, megatron.mpu.overlap).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.mpu.utils import divide, group_rank, group_size


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's 1 / p of `dim`, a view (x itself for a group of one)."""
    size = group_size(group)
    if size == 1:
        return x
    local = divide(x.size(dim), size)
    return x.narrow(dim, group_rank(group) * local, local)


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's 1 / p of `dim`, contiguous (x itself for a group of one)."""
    part = _slice(x, group, dim)
    return part if part is x else part.contiguous()


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order (x itself for a group of one)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The sum over ranks, each keeping its 1 / p of `dim` (x itself for a group of one)."""
    size = group_size(group)
    if size == 1:
        return x
    divide(x.size(dim), size)  # raises on a dimension the group cannot split
    chunks = [c.contiguous() for c in torch.chunk(x, size, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _region(name: str, forward: Callable, backward: Callable) -> type:
    """An autograd function of (x, group): `forward(x, group)` going in, the dual collective
    `backward(grad, group)` coming back."""

    def run_forward(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx, grad):
        return backward(grad, ctx.group), None

    body = {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)}
    return type(name, (torch.autograd.Function,), body)


def _last(op: Callable) -> Callable:
    return lambda x, group: op(x, group, -1)


_CopyToRegion = _region("_CopyToRegion", _identity, _all_reduce)
_ReduceFromRegion = _region("_ReduceFromRegion", _all_reduce, _identity)
_ScatterToRegion = _region("_ScatterToRegion", _last(_split), _last(_gather))
_GatherFromRegion = _region("_GatherFromRegion", _last(_gather), _last(_split))


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce of the gradient over TP."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce (sum) over TP. Backward: identity."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather of the gradient."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather of the last dim over TP. Backward: this rank's gradient chunk."""
    return _GatherFromRegion.apply(x, group)


# ---- sequence parallelism: activations split along dim 1 (the sequence) over TP ----

SEQUENCE_DIM = 1  # activations are (b, s, h)


def sequence_slice(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This TP rank's contiguous s / p positions of `x` along `dim` (no autograd, no copy of
    the rest): rank r holds positions [r s/p, (r + 1) s/p)."""
    return _slice(x, group, dim)


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/p, h) on each rank -> (b, s, h), rank order (no autograd: for autograd functions
    that do their own backward, such as the sequence-parallel column-parallel linear)."""
    return _gather(x, group, SEQUENCE_DIM)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) on each rank -> this rank's s / p positions of the sum over ranks (no
    autograd)."""
    return _reduce_scatter(x, group, SEQUENCE_DIM)


def _sequence_slice(x: torch.Tensor, group) -> torch.Tensor:
    return sequence_slice(x, group).contiguous()


_ScatterToSequenceRegion = _region("_ScatterToSequenceRegion", _sequence_slice, all_gather_sequence)
_ReduceScatterToSequenceRegion = _region(
    "_ReduceScatterToSequenceRegion", reduce_scatter_sequence, all_gather_sequence
)


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
        return _sequence_slice(grad, ctx.group), None, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's s / p positions. Backward: all-gather of the gradient."""
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, grad_is_partial: bool = True
) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: sum over TP, each rank keeping its s / p positions. Backward: all-gather."""
    return _ReduceScatterToSequenceRegion.apply(x, group)


# ---- expert parallelism: tokens (n, h) exchanged along dim 0 over the EP group ----


def _all_to_all(x: torch.Tensor, group, output_splits, input_splits, hand_over) -> torch.Tensor:
    """Launched asynchronously; `hand_over()` (when given) runs while the tokens travel
    (DualPipeV passes the turn to the other micro batch of its overlapped pair there,
    megatron.mpu.overlap, which computes meanwhile); waited."""
    out, x = x.new_empty((sum(output_splits), *x.shape[1:])), x.contiguous()
    work = dist.all_to_all_single(
        out,
        x,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=True,
    )
    if hand_over is not None:
        hand_over()
    work.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rows [sum(input_splits[:j]), +input_splits[j]) go to EP rank j, and rank j's
    rows for this rank arrive in rank order (output_splits). Backward: the reverse all-to-all.
    Both call `hand_over` while in flight (the hook the caller gave, or none)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, hand_over):
        ctx.group, ctx.splits, ctx.hand_over = group, (output_splits, input_splits), hand_over
        return _all_to_all(x, group, output_splits, input_splits, hand_over)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad = _all_to_all(grad, ctx.group, input_splits, output_splits, ctx.hand_over)
        return grad, None, None, None, None


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """(p x n,) counts, slice j for rank j -> (p, n): row j what rank j sent here (no autograd;
    the split sizes of the all-to-all that follows)."""
    size = group_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(size, -1)


def all_to_all(
    x: torch.Tensor,
    group,
    output_splits: list[int],
    input_splits: list[int],
    hand_over: Callable[[], None] | None = None,
):
    """(sum(input_splits), ...) -> (sum(output_splits), ...): the token exchange of the MoE
    alltoall dispatcher (identity for a group of one). `hand_over`: called between launching
    the exchange and waiting for it, in forward and backward (the MoE layer's hook, given by
    megatron.mpu.overlap.PairOverlap for DualPipeV's overlapped pairs); none: just waited."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits), hand_over)


def _rows(op: Callable) -> Callable:
    return lambda x, group: op(x, group, 0)


_GatherRows = _region("_GatherRows", _rows(_gather), _rows(_reduce_scatter))
_ReduceScatterRows = _region("_ReduceScatterRows", _rows(_reduce_scatter), _rows(_gather))


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x stacked along dim 0 in rank order (no autograd: routing decisions)."""
    return _gather(x, group, 0)


def gather_from_expert_region(x: torch.Tensor, group) -> torch.Tensor:
    """Every EP rank's tokens on every EP rank (the MoE allgather dispatcher): an all-gather of
    dim 0 (equal sizes, rank order); backward: a reduce-scatter (each rank's gradient of the
    gathered rows is a partial sum over the experts it holds)."""
    return x if group_size(group) == 1 else _GatherRows.apply(x, group)


def reduce_scatter_to_expert_region(x: torch.Tensor, group) -> torch.Tensor:
    """The experts' partial outputs of all EP ranks' tokens, summed, back to their owners: each
    rank keeps its 1/p of dim 0 of the sum; backward: an all-gather."""
    return x if group_size(group) == 1 else _ReduceScatterRows.apply(x, group)

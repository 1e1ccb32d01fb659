"""Tensor-parallel layers. At TP = 1 each is exactly its torch twin (nn.Linear, nn.Embedding).

Weights are initialized on a full-size CPU "master" tensor and then sliced, so a seed gives the
same model at every TP size. Every sharded parameter carries `tensor_model_parallel = True`,
`partition_dim` and `partition_stride`, which grads/checkpoint code use to count or rebuild it.

`sequence_parallel=True` (Megatron's sequence parallelism): outside the linear layers the
activations hold s / p positions per TP rank. A column-parallel layer all-gathers its input
along the sequence (backward: reduce-scatter), a row-parallel one reduce-scatters its output
(backward: all-gather) instead of all-reducing it. A replicated parameter applied to those
slices (row-parallel bias, norm weights) gets a gradient from s / p tokens only; it is marked
`sequence_parallel = True`, and its gradient is summed over TP before the optimizer
(megatron.mpu.grads.all_reduce_sequence_parallel_grads).

`fp8`: a linear whose `fp8` slot holds a Float8Matmul (megatron.mpu.fp8; set by
megatron.model.fp8.apply_fp8) computes its local GEMMs in float8; the collectives around them
are unchanged.

`weight_grad_split`: a layer whose `weight_grad_split` slot holds a
megatron.mpu.weight_grad.WeightGradSplit (given for a zero-bubble step by the pipeline,
megatron.training.pipeline) queues its weight gradient in B for a later W; with None (any other
time, and any model not given one) its backward is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.mappings import (
    all_gather_sequence,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.utils import divide, group_rank, group_size, shard
from megatron.mpu.weight_grad import WeightGradSplit

InitMethod = Callable[[torch.Tensor], None]


def init_normal(std: float = 0.02, generator: torch.Generator | None = None) -> InitMethod:
    def init_(tensor: torch.Tensor) -> None:
        tensor.normal_(0.0, std, generator=generator)

    return init_


_DEFAULT_INIT = init_normal(0.02)


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int = 0, stride: int = 1
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """`param` is replicated over TP but sees only this rank's s / p tokens: its gradient must
    be summed over the TP group before the optimizer uses it."""
    param.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def partition_of(param: torch.Tensor) -> tuple[int, int] | None:
    """(partition_dim, partition_stride) of a TP-split parameter; None if every TP rank holds
    all of it. What a checkpoint records per tensor, so converters need not guess."""
    if not is_tensor_parallel(param):
        return None
    return int(param.partition_dim), int(param.partition_stride)


@torch.no_grad()
def copy_full_into_param(param: torch.Tensor, full: torch.Tensor, group) -> None:
    """Load this rank's slice of the full (unsharded) tensor `full` into `param`."""
    if is_tensor_parallel(param):
        full = shard(
            full, param.partition_dim, group_rank(group), group_size(group), param.partition_stride
        )
    if full.shape != param.shape:
        raise ValueError(f"shape {tuple(full.shape)} does not fit parameter {tuple(param.shape)}")
    param.copy_(full)


def _init_param(param: nn.Parameter, full_shape, init_method: InitMethod | None, group) -> None:
    """Fill the full-size master with `init_method` and keep this rank's slice.

    `init_method=None` leaves the parameter uninitialized: the owner (e.g. GPTModel, which seeds
    each weight by its name) loads it afterwards.
    """
    if init_method is None:
        return
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    copy_full_into_param(param, master, group)


class _GatheredLinear(torch.autograd.Function):
    """Y = [X_1; ...; X_p] A_i + b_i: the sequence-parallel input all-gathered into a linear.

    Keeps only this rank's slice X_r (b, s/p, h) for backward and all-gathers it again there,
    so the full (b, s, h) input is never held between forward and backward (the point of
    sequence parallelism's memory saving). Backward: dL/dX reduce-scattered along the sequence,
    dL/dA_i = dL/dY^T X, dL/db_i = sum of dL/dY.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, fp8, owner=None):  # owner: (parameter, split)
        ctx.group, ctx.has_bias, ctx.fp8, ctx.owner = group, bias is not None, fp8, owner
        ctx.save_for_backward(x, weight)
        full = all_gather_sequence(x, group)  # (b, s, h)
        if fp8 is None:
            return F.linear(full, weight, bias)  # (b, s, out / p)
        y = fp8.forward_mm(full, weight)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.fp8 is not None:  # both products from the float8 math
            full = all_gather_sequence(x, ctx.group)  # (b, s, h), again
            grad_full, grad_w = ctx.fp8.backward_mm(grad, full, weight)
            grad_x = reduce_scatter_sequence(grad_full, ctx.group)  # (b, s/p, h)
        if ctx.fp8 is None and ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_sequence(grad.matmul(weight), ctx.group)  # (b, s/p, h)
        if ctx.fp8 is None and (ctx.needs_input_grad[1] or ctx.owner is not None):
            full = all_gather_sequence(x, ctx.group)  # (b, s, h), again
            flat = full.reshape(-1, full.size(-1))
            if ctx.owner is not None:  # zero-bubble: a later W computes it
                param, split = ctx.owner
                split.linear_weight_grad(param, grad, full)
            else:
                grad_w = grad.reshape(-1, grad.size(-1)).t().matmul(flat)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.size(-1)).sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def local_linear(
    x: torch.Tensor, weight: torch.Tensor, bias=None, fp8=None, split: WeightGradSplit | None = None
) -> torch.Tensor:
    """X W^T + b on this rank, in float8 when `fp8` (a megatron.mpu.fp8.Float8Matmul) is given;
    dL/dW queued in `split` for a later W when one is given (and no fp8)."""
    if fp8 is None:
        return F.linear(x, weight, bias) if split is None else split.linear(x, weight, bias)
    return fp8.linear(x, weight, bias)


def gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias, group, fp8=None, split=None
) -> torch.Tensor:
    """Sequence-parallel X (b, s/p, h) all-gathered into X A^T + b, keeping only the slice for
    backward (see _GatheredLinear); `weight` is this rank's (out / p, h) shard. `split`: as
    local_linear's."""
    if group_size(group) == 1:
        return local_linear(x, weight, bias, fp8, split)
    if split is not None and fp8 is None and weight.requires_grad:  # dL/dA queued for a W
        return _GatheredLinear.apply(x, weight.detach(), bias, group, fp8, (weight, split))
    return _GatheredLinear.apply(x, weight, bias, group, fp8)


def _add_sharded_weight(layer, shape, dim, stride, init_method, group, kw) -> None:
    """A parallel linear's weight A (output_size x input_size), this rank's `shape` slice of it
    along `dim`, initialized as the whole matrix would be, and the slots its forward reads."""
    layer.fp8 = None  # a Float8Matmul: float8 GEMMs (megatron.model.fp8.apply_fp8)
    layer.weight_grad_split = None  # a WeightGradSplit: dL/dA for a later W (module doc)
    layer.weight = nn.Parameter(torch.empty(*shape, **kw))
    set_tensor_model_parallel_attributes(layer.weight, True, dim, stride)
    _init_param(layer.weight, (layer.output_size, layer.input_size), init_method, group)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b, A split along its output dimension: A = [A_1, ..., A_p], rank i holds A_i.

    Forward: copy_to (identity) -> Y_i = X A_i + b_i -> optional all-gather of [Y_1 .. Y_p].
    Backward: all-reduce of dL/dX over TP (from copy_to).
    sequence_parallel: X arrives as this rank's (b, s/p, h); forward all-gathers it along the
    sequence, backward reduce-scatters dL/dX (the all-reduce and the split in one) and gathers
    X again for dL/dA, so only the slice is kept for backward.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        group=None,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod | None = _DEFAULT_INIT,
        stride: int = 1,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        local = divide(output_size, group_size(group))
        kw = {"device": device, "dtype": dtype}
        _add_sharded_weight(self, (local, input_size), 0, stride, init_method, group, kw)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local, **kw))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.sequence_parallel:  # x: (b, s/p, h)
            return gathered_linear(
                x, self.weight, bias, self.group, self.fp8, self.weight_grad_split
            )
        x = copy_to_tensor_model_parallel_region(x, self.group)
        return local_linear(x, self.weight, bias, self.fp8, self.weight_grad_split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)  # (..., output_size / p)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        """X A_i only, for a caller that fuses the bias into the next op (bias + GeLU)."""
        return self._linear(x, None)


class RowParallelLinear(nn.Module):
    """Y = XA + b, A split along its input dimension: A = [A_1; ...; A_p], X = [X_1, ..., X_p].

    Forward: (scatter X unless input_is_parallel) -> X_i A_i -> all-reduce (sum) -> + b.
    Backward: identity through the reduce; all-gather of dL/dX if the input was scattered.
    sequence_parallel: the sum is a reduce-scatter along the sequence, so Y leaves as this
    rank's (b, s/p, h) (backward: all-gather of dL/dY); b is then added to s / p tokens only.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        group=None,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = _DEFAULT_INIT,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear needs input_is_parallel=True")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        local = divide(input_size, group_size(group))
        kw = {"device": device, "dtype": dtype}
        _add_sharded_weight(self, (output_size, local), 1, 1, init_method, group, kw)
        if bias:
            # The bias is added once, after the reduce, so every rank holds all of it.
            self.bias = nn.Parameter(torch.zeros(output_size, **kw))
            set_tensor_model_parallel_attributes(self.bias, False)
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_without_bias(x)
        return y if self.bias is None else y + self.bias

    def forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced X A only, for a caller that adds b itself (--bias-dropout-fusion)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = local_linear(x, self.weight, None, self.fp8, self.weight_grad_split)  # partial sum
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.group)  # (b, s/p, h)
        return reduce_from_tensor_model_parallel_region(y, self.group)


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the vocab rows split over TP: rank i holds rows [i V/p, (i+1) V/p).

    Forward: each rank looks up the ids it owns (zeros elsewhere) -> all-reduce (sum).
    Backward: identity; each rank's weight gradient lands only on its own rows.
    forward(ids, sequence_parallel=True): the sum is a reduce-scatter along the sequence, and
    the output is this rank's (b, s/p, h) (backward: all-gather of the gradient).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group=None,
        init_method: InitMethod | None = _DEFAULT_INIT,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight_grad_split = None  # a WeightGradSplit: the whole backward in a W
        local = divide(num_embeddings, group_size(group))
        self.vocab_start = group_rank(group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        _init_param(self.weight, (num_embeddings, embedding_dim), init_method, group)

    def forward(self, ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        split = self.weight_grad_split
        embedding = F.embedding if split is None else split.embedding
        if group_size(self.group) == 1:
            return embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_model_parallel_region(out, self.group)

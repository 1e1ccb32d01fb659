"""Weight gradients computed apart from input gradients (the zero-bubble pipeline schedules).

A zero-bubble schedule (megatron.schedules: ZB-H1, ZBV, DualPipeV) splits a micro batch's
backward into B, the gradient to the stage's input that the previous stage waits for, and W,
the weight gradients that nobody waits for and that run later, in a hole of the pipeline.

The split is an object, `WeightGradSplit`, that the pipeline (megatron.training.pipeline) keeps
per model and gives to its layers for each zero-bubble step (`given_to(model)`: every module
with a `weight_grad_split` slot holds it until the step ends); nothing here is global, so a model
whose layers were not given one computes plain gradients beside it. The layers holding one
(megatron.mpu.layers: column / row parallel, sequence parallel; the output head; the MoE
experts' grouped matmuls; the vocab-parallel embedding) run through the autograd functions
below. They see their weight detached (autograd never reaches the parameter during B) and
keep the parameter and the split aside; their backward computes the input gradient and
appends to the split's open queue (`deferring(queue)`, opened around every backward the
pipeline runs) what computes the weight gradient later (the saved input and output gradient).
`run_weight_grads(queue)` computes them first in, first out and hands each to autograd as the
parameter's gradient, so it accumulates into `.grad` and fires the post-accumulate hooks that
move it into DDP's fp32 buffer (megatron.data_parallel.ddp) as an ordinary backward would; a
backward with no W of its own (1F1B's, DualPipeV's full ones) runs its queue at once. A queued
entry names the tensors it holds until its W (the linear's input and output gradient, the
embedding's ids and output gradient), so memory accounting sees them (`holding(pack,
unpack)`, megatron.model.memory.LiveActivations). Biases and norm weights keep their gradients
in B (they cost next to nothing). fp8 GEMMs and the fused linear cross-entropy compute both
gradients in B (their kernels produce them together).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.mpu.utils import handed_to

SLOT = "weight_grad_split"  # the attribute of the layers that take a WeightGradSplit


class WeightGradSplit:
    """The split of one model's backward: the layers given it build ops whose weight gradient
    is queued by B (into the queue `deferring` opened) for a later W."""

    def __init__(self):
        self.queue: list | None = None  # the open backward's queue
        self.hooks: tuple[Callable, Callable] | None = None  # (pack, unpack) of queued tensors

    def given_to(self, model: torch.nn.Module):
        """Inside, the layers of `model` that take a split (a `weight_grad_split` slot) hold
        this one; afterwards what they held before."""
        return handed_to(model, SLOT, self)

    @contextlib.contextmanager
    def deferring(self, queue: list):
        """Backwards inside append their weight-gradient work to `queue` instead of running it."""
        previous, self.queue = self.queue, queue
        try:
            yield
        finally:
            self.queue = previous

    def holding(self, pack: Callable, unpack: Callable) -> None:
        """Tensors queued from now on are stored as pack(t) and given back as unpack(packed)
        at their W: autograd's saved_tensors_hooks for the weight-gradient queue (memory
        accounting)."""
        self.hooks = (pack, unpack)

    def queue_weight_grad(self, param: torch.Tensor, compute: Callable, *tensors) -> None:
        """Queue compute(*tensors) (dL/dparam) for run_weight_grads; the queue holds `tensors`
        until then (compute must capture no other activation)."""
        if self.queue is None:
            raise RuntimeError(
                "a backward through split weight gradients ran outside WeightGradSplit.deferring "
                "(megatron.training.pipeline opens the queue around every backward it runs)"
            )
        pack, unpack = self.hooks or (None, None)
        if pack is not None:
            tensors = tuple(pack(t) for t in tensors)
        self.queue.append((param, compute, tensors, unpack))

    def linear_weight_grad(self, weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor):
        """Queue the weight gradient of Y = X W^T from dL/dY and X."""
        self.queue_weight_grad(weight, _linear_weight_grad, grad, x)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        """X W^T + b with a deferred dL/dW."""
        return _SplitLinear.apply(x, weight.detach(), bias, (weight, self), _anchor(weight))

    def grouped_matmul(self, x, w, counts: list[int], matmul: Callable) -> torch.Tensor:
        """`matmul(x, w, counts)` (megatron.model.moe.grouped_matmul) with a deferred dL/dw."""
        return _SplitGroupedMatmul.apply(x, w.detach(), counts, matmul, (w, self), _anchor(w))

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """weight[ids] with a deferred dL/dweight (the whole backward)."""
        return _SplitEmbedding.apply(ids, weight.detach(), (weight, self), _anchor(weight))


def run_weight_grads(queue: list) -> None:
    """Compute the queued weight gradients (first in, first out) and accumulate them."""
    sums: dict[int, list] = {}
    while queue:  # each entry (and what it holds) dropped once computed
        param, compute, tensors, unpack = queue.pop(0)
        grad = compute(*(tensors if unpack is None else [unpack(t) for t in tensors]))
        del tensors
        entry = sums.setdefault(id(param), [param, None])
        entry[1] = grad if entry[1] is None else entry[1] + grad
    if sums:
        params, grads = zip(*sums.values(), strict=True)
        torch.autograd.backward(list(params), list(grads))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


class _SplitLinear(torch.autograd.Function):
    """Y = X W^T + b with `weight` detached (autograd never reaches the parameter in B) and
    the parameter itself and the split in `owner`, a tuple autograd does not track: dL/dW is
    queued for it in the split's open queue."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, anchor):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.owner = bias is not None, owner
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        param, split = ctx.owner
        if param.requires_grad:
            split.linear_weight_grad(param, grad, x)
        grad_b = _flat(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None, None


def _anchor(weight: torch.Tensor) -> torch.Tensor | None:
    """An empty leaf that requires grad where the parameter does: it keeps the output in the
    graph when no other input requires grad (the embedding), without autograd touching the
    parameter itself."""
    if not weight.requires_grad:
        return None
    return torch.empty(0, device=weight.device, requires_grad=True)


def _linear_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _flat(grad).t().matmul(_flat(x))


class _SplitGroupedMatmul(torch.autograd.Function):
    """Rows of x (N, a) in groups of `counts`, group g times w[g] (G, a, c); `w` detached,
    the parameter and the split in `owner` (as _SplitLinear)."""

    @staticmethod
    def forward(ctx, x, w, counts, matmul, owner, anchor):
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.matmul, ctx.owner = counts, matmul, owner
        return matmul(x, w, counts)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad, counts = grad.contiguous(), ctx.counts
        grad_x = ctx.matmul(grad, w.transpose(1, 2).contiguous(), counts)
        param, split = ctx.owner
        if param.requires_grad:
            weight_grad = functools.partial(_grouped_weight_grad, w=w, counts=counts)
            split.queue_weight_grad(param, weight_grad, x, grad)
        return grad_x, None, None, None, None, None


def _grouped_weight_grad(x, grad, w, counts) -> torch.Tensor:
    out = torch.zeros_like(w)
    pairs = zip(torch.split(x, counts), torch.split(grad, counts), strict=True)
    for g, (xg, gg) in enumerate(pairs):
        if xg.size(0):
            out[g] = xg.t().matmul(gg)
    return out


class _SplitEmbedding(torch.autograd.Function):
    """weight[ids]: no input gradient, so the whole backward is W."""

    @staticmethod
    def forward(ctx, ids, weight, owner, anchor):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.owner = weight.shape, owner
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        param, split = ctx.owner
        if param.requires_grad:
            weight_grad = functools.partial(_embedding_weight_grad, shape=ctx.shape)
            split.queue_weight_grad(param, weight_grad, ids, grad)
        return None, None, None, None


def _embedding_weight_grad(ids: torch.Tensor, grad: torch.Tensor, shape) -> torch.Tensor:
    out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    return out.index_add_(0, ids.reshape(-1), _flat(grad))

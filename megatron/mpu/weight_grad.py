"""Weight gradients computed apart from input gradients (the zero-bubble pipeline schedules).

A zero-bubble schedule (megatron.pipeline_order: zb-h1, zbv, dualpipev) splits a micro batch's
backward into B, the gradient to the stage's input that the previous stage waits for, and W,
the weight gradients that nobody waits for and that run later, in a hole of the pipeline.

While `splitting()` (the schedule's whole step, `split_weight_grads()`), the linears
(megatron.mpu.layers: column / row parallel, sequence parallel, the untied head), the MoE
experts' grouped matmuls and the vocab-parallel embedding run through the autograd functions
below. They see their weight detached (autograd never reaches the parameter during B) and
keep the parameter aside; their backward computes the input gradient and appends to the queue
of `defer_weight_grads(queue)` what computes the weight gradient later (the saved input and
output gradient). `run_weight_grads(queue)` computes them first in, first out and hands each
to autograd as the parameter's gradient, so it accumulates into `.grad` and fires the
post-accumulate hooks that move it into DDP's fp32 buffer (megatron.data_parallel.ddp) as an
ordinary backward would; a backward with no W of its own (1F1B's, DualPipeV's full ones) runs
its queue at once. A queued entry names the tensors it holds until its W (the linear's input
and output gradient, the embedding's ids and output gradient), so memory accounting sees them
(`weight_grad_hooks`, megatron.model.memory.LiveActivations). Biases and norm weights keep
their gradients in B (they cost next to nothing). fp8 GEMMs and the fused linear cross-entropy
compute both gradients in B (their kernels produce them together).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

_state: dict = {"split": False, "queue": None, "hooks": None}


def splitting() -> bool:
    return _state["split"]


@contextlib.contextmanager
def split_weight_grads(enabled: bool = True):
    """Forwards inside build ops whose weight gradient can be deferred."""
    previous, _state["split"] = _state["split"], enabled
    try:
        yield
    finally:
        _state["split"] = previous


@contextlib.contextmanager
def defer_weight_grads(queue: list):
    """Backwards inside append their weight-gradient work to `queue` instead of running it."""
    previous, _state["queue"] = _state["queue"], queue
    try:
        yield
    finally:
        _state["queue"] = previous


@contextlib.contextmanager
def weight_grad_hooks(pack: Callable, unpack: Callable):
    """Tensors queued inside are stored as pack(t) and given back as unpack(packed) at their
    W: autograd's saved_tensors_hooks for the weight-gradient queue (memory accounting)."""
    previous, _state["hooks"] = _state["hooks"], (pack, unpack)
    try:
        yield
    finally:
        _state["hooks"] = previous


def queue_weight_grad(param: torch.Tensor, compute: Callable, *tensors: torch.Tensor) -> None:
    """Queue compute(*tensors) (dL/dparam) for run_weight_grads; the queue holds `tensors`
    until then (compute must capture no other activation)."""
    queue = _state["queue"]
    if queue is None:
        raise RuntimeError(
            "a backward through split weight gradients ran outside defer_weight_grads "
            "(megatron.training.pipeline opens the queue around every backward it runs)"
        )
    pack, unpack = _state["hooks"] or (None, None)
    if pack is not None:
        tensors = tuple(pack(t) for t in tensors)
    queue.append((param, compute, tensors, unpack))


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
    the parameter itself in `owner`, a tuple autograd does not track: dL/dW is queued for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner, anchor):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.owner = bias is not None, owner
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.owner[0].requires_grad:
            linear_weight_grad(ctx.owner[0], grad, x)
        grad_b = _flat(grad).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None, None


def _anchor(weight: torch.Tensor) -> torch.Tensor | None:
    """An empty leaf that requires grad where the parameter does: it keeps the output in the
    graph when no other input requires grad (the embedding), without autograd touching the
    parameter itself."""
    if not weight.requires_grad:
        return None
    return torch.empty(0, device=weight.device, requires_grad=True)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    return _SplitLinear.apply(x, weight.detach(), bias, (weight,), _anchor(weight))


def linear_weight_grad(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """Queue the weight gradient of Y = X W^T from dL/dY and X."""
    queue_weight_grad(weight, _linear_weight_grad, grad, x)


def _linear_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _flat(grad).t().matmul(_flat(x))


class _SplitGroupedMatmul(torch.autograd.Function):
    """Rows of x (N, a) in groups of `counts`, group g times w[g] (G, a, c); `w` detached,
    the parameter in `owner` (as _SplitLinear)."""

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
        if ctx.owner[0].requires_grad:
            weight_grad = functools.partial(_grouped_weight_grad, w=w, counts=counts)
            queue_weight_grad(ctx.owner[0], weight_grad, x, grad)
        return grad_x, None, None, None, None, None


def _grouped_weight_grad(x, grad, w, counts) -> torch.Tensor:
    out = torch.zeros_like(w)
    pairs = zip(torch.split(x, counts), torch.split(grad, counts), strict=True)
    for g, (xg, gg) in enumerate(pairs):
        if xg.size(0):
            out[g] = xg.t().matmul(gg)
    return out


def split_grouped_matmul(x, w, counts: list[int], matmul: Callable) -> torch.Tensor:
    """`matmul(x, w, counts)` (megatron.model.moe.grouped_matmul) with a deferred dL/dw."""
    return _SplitGroupedMatmul.apply(x, w.detach(), counts, matmul, (w,), _anchor(w))


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
        if ctx.owner[0].requires_grad:
            weight_grad = functools.partial(_embedding_weight_grad, shape=ctx.shape)
            queue_weight_grad(ctx.owner[0], weight_grad, ids, grad)
        return None, None, None, None


def _embedding_weight_grad(ids: torch.Tensor, grad: torch.Tensor, shape) -> torch.Tensor:
    out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    return out.index_add_(0, ids.reshape(-1), _flat(grad))


def split_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _SplitEmbedding.apply(ids, weight.detach(), (weight,), _anchor(weight))

"""Global gradient norm and clipping over a model split across TP and PP ranks.

A parameter split over TP (MoE experts split over expert-TP too) contributes its shard on every
TP rank; a replicated one (norm weights, row-parallel biases, position embeddings) is counted on
TP rank 0 only, and a parameter marked `shared` (the last stage's copy of a tied embedding) is
not counted at all, so every weight enters the norm exactly once. Partial sums are then
all-reduced over the model-parallel group; those of MoE experts (`expert_parallel`, different
experts on each rank of the EP group) over the EP group first.

With sequence parallelism, the gradients of the replicated parameters that saw only a slice of
the tokens are summed over TP first (`all_reduce_sequence_parallel_grads`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.mpu.layers import is_sequence_parallel, is_tensor_parallel
from megatron.mpu.utils import group_size


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulate in float32, or wider if the gradient already is."""
    return torch.promote_types(t.dtype, torch.float32)


def counts_once(param: torch.Tensor, tp_rank: int) -> bool:
    if getattr(param, "shared", False):
        return False
    split = is_tensor_parallel(param) or getattr(param, "expert_tensor_parallel", False)
    return split or tp_rank == 0


def per_tensor_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's norm, accumulated in float32 or wider: fp32/fp64 gradients (our DDP's
    main_grad) in one fused kernel per dtype (torch._foreach_norm, as torch's clip_grad_norm_),
    others one by one, upcast."""
    wide = [g for g in grads if g.dtype == _acc(g)]
    narrow = [g for g in grads if g.dtype != _acc(g)]
    out = []
    for dtype in sorted({g.dtype for g in wide}, key=str):
        out += list(torch._foreach_norm([g for g in wide if g.dtype == dtype], norm_type))
    return out + [torch.linalg.vector_norm(g, norm_type, dtype=_acc(g)) for g in narrow]


def grad_norm(
    parameters: Iterable[torch.Tensor],
    *,
    tp_rank: int = 0,
    model_parallel_group=None,
    norm_type: float = 2.0,
    expert_group=None,
) -> torch.Tensor:
    """The norm of all gradients of the whole model (float32 scalar, same on every MP rank).
    `expert_group`: the EP group, over which the `expert_parallel` gradients differ."""
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    inf = norm_type == math.inf
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    totals = []
    for experts in (False, True):
        grads = [
            p.grad.detach()
            for p in params
            if counts_once(p, tp_rank) and getattr(p, "expert_parallel", False) == experts
        ]
        if inf:
            local = [g.abs().max().to(_acc(g)) for g in grads]
            part = torch.stack(local).max() if local else torch.zeros((), device=device)
        else:
            local = [n**norm_type for n in per_tensor_norms(grads, norm_type)]
            part = torch.stack(local).sum() if local else torch.zeros((), device=device)
        if experts and group_size(expert_group) > 1:
            dist.all_reduce(part, op=op, group=expert_group)
        totals.append(part)
    total = torch.stack(totals).max() if inf else torch.stack(totals).sum()
    if group_size(model_parallel_group) > 1:
        dist.all_reduce(total, op=op, group=model_parallel_group)
    return total if inf else total ** (1.0 / norm_type)


def all_reduce_sequence_parallel_grads(
    parameters: Iterable[torch.Tensor], group, attr: str = "main_grad"
) -> int:
    """Sum over TP the gradients of parameters marked `sequence_parallel` (replicated over TP
    but applied to s / p tokens per rank: norm weights, row-parallel biases, the position table),
    so each holds dL/dw over every token of the sequence. `attr`: where the gradient is
    ("main_grad" for our DDP buffers, "grad" otherwise). One all-reduce of the flattened
    gradients; returns how many parameters took part."""
    grads = [getattr(p, attr) for p in parameters if is_sequence_parallel(p)]
    grads = [g for g in grads if g is not None]
    if not grads or group_size(group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)


def reduce_sequence_parallel_grads_in_backward(parameters: Iterable[torch.Tensor], group) -> int:
    """The same sum, done by a hook on each marked parameter's fresh gradient before autograd
    accumulates it: for a trainer (DeepSpeed's engine) that reduces and steps inside its own
    backward()/step(), leaving no point to do it before the optimizer. One small all-reduce
    per parameter per micro batch; returns how many parameters got a hook."""
    marked = [p for p in parameters if is_sequence_parallel(p) and p.requires_grad]
    if group_size(group) == 1:
        return 0

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    for p in marked:
        p.register_hook(hook)
    return len(marked)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    tp_rank: int = 0,
    model_parallel_group=None,
    norm_type: float = 2.0,
    expert_group=None,
) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / norm); returns the norm before clipping.

    A non-finite norm is returned untouched and nothing is scaled: the caller skips the step.
    The coefficient stays on the device (computed in float64, as a Python float would be), so
    clipping never makes the host wait for the gradients.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(
        params,
        tp_rank=tp_rank,
        model_parallel_group=model_parallel_group,
        norm_type=norm_type,
        expert_group=expert_group,
    )
    if max_norm > 0 and params:
        coef = (max_norm / (total.double() + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        torch._foreach_mul_([p.grad for p in params], coef)
    return total

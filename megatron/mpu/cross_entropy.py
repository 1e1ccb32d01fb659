"""Cross-entropy over logits whose vocab dimension is split across the TP group.

loss = log(sum_v exp(z_v - m)) - (z_target - m), with m the global max. Each rank works on its
V/p slice; only [*, 1]-sized partial results (max, sum of exps, target logit) are all-reduced,
so the full [*, V] logits are never gathered. Backward: softmax - onehot(target), locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.utils import group_rank, group_size


def _all_reduce(x: torch.Tensor, op, group) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, upcast):
        # logits: (*, V/p) this rank's vocab slice; target: (*,) global ids
        local_v = logits.size(-1)
        start = group_rank(group) * local_v
        # >= fp32 math, or the logits' own dtype; never in place (the caller's logits stay).
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) if upcast else logits
        zmax = z.max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        z = z - zmax.unsqueeze(-1)

        outside = (target < start) | (target >= start + local_v)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        exp = z.exp_()  # reuse z's memory: (*, V/p)
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # in place: the (*, V/p) buffer is the largest in the step
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group=None, upcast: bool = True
):
    """Per-token loss (shape of `target`) from vocab-sharded `logits` (*, V/p): computed in
    float32 (or wider), or with `upcast=False` in the logits' own dtype (Megatron-LM v1.x's
    --fp16-lm-cross-entropy: no fp32 copy of the logits, an fp16 loss)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, upcast)

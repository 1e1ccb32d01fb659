"""Vocab-parallel cross-entropy with Triton kernels, never holding an fp32 copy of the logits.

loss = log(sum_v exp(z_v - m)) - (z_target - m), m the global max, as in
megatron.mpu.cross_entropy (same contract): each rank holds a V/p slice of the logits, and only
per-row statistics cross ranks. Kernel A: local row max -> all-reduce MAX. Kernel B: local
sum_v exp(z_v - m) and z_target - m (0 when the target is another rank's) -> all-reduce SUM.
Backward: grad = (softmax - onehot(target)) * dloss, written straight in the logits' dtype,
recomputing softmax from the saved logits, m and the sum. Logits of -inf (padded vocab) get
probability 0 and no NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.fused_kernels._triton import (
    check_kernel_input,
    tl,
    triton,
)
from megatron.fused_kernels._triton import jit as _jit
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.utils import group_rank, group_size

# Vocab columns per loop step (rows kernels) and per program (backward); tests lower it.
MAX_BLOCK = 4096

# The torch reference / fallback, with the same signature and contract.
torch_vocab_parallel_cross_entropy = vocab_parallel_cross_entropy


@_jit
def _row_max_kernel(logits_ptr, max_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(logits_ptr + row * n_cols + cols, mask=cols < n_cols, other=float("-inf"))
        acc = tl.maximum(acc, z.to(tl.float32))
    tl.store(max_ptr + row, tl.max(acc, 0))


@_jit
def _sum_exp_target_kernel(
    logits_ptr,
    target_ptr,
    max_ptr,
    sum_exp_ptr,
    target_logit_ptr,
    n_cols,
    vocab_start,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = logits_ptr + row * n_cols
    m = tl.load(max_ptr + row)  # the global max
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        acc += tl.exp(z - m)  # exp(-inf) = 0 for padding and out-of-row lanes
    tl.store(sum_exp_ptr + row, tl.sum(acc, 0))

    local = tl.load(target_ptr + row) - vocab_start
    inside = (local >= 0) & (local < n_cols)
    z_t = tl.load(z_row + local, mask=inside, other=0.0).to(tl.float32)
    tl.store(target_logit_ptr + row, tl.where(inside, z_t - m, 0.0))


@_jit
def _grad_kernel(
    logits_ptr,
    target_ptr,
    max_ptr,
    sum_exp_ptr,
    dloss_ptr,
    grad_ptr,
    n_cols,
    vocab_start,
    BLOCK: tl.constexpr,
):
    """One (row, column block): (exp(z - m) / sum_exp - onehot) * dloss."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n_cols
    m = tl.load(max_ptr + row)
    dloss = tl.load(dloss_ptr + row)
    scale = dloss / tl.load(sum_exp_ptr + row)
    z = tl.load(logits_ptr + row * n_cols + cols, mask=keep, other=float("-inf")).to(tl.float32)
    local = tl.load(target_ptr + row) - vocab_start  # a column outside [0, n_cols) never matches
    grad = tl.exp(z - m) * scale - tl.where(cols == local, dloss, 0.0)
    tl.store(grad_ptr + row * n_cols + cols, grad.to(grad_ptr.dtype.element_ty), mask=keep)


def _all_reduce(x: torch.Tensor, op, group) -> None:
    # Per-row statistics only ((*,) fp32); as in mpu.cross_entropy, the one place besides
    # mpu.mappings that reduces inside a forward.
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


def _block(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    return block, min(max(block // 256, 1), 8)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        local_v = logits.shape[-1]
        vocab_start = group_rank(group) * local_v
        z = logits.contiguous().view(-1, local_v)  # (N, V/p), N = target.numel()
        t = target.contiguous().view(-1).to(torch.int64)  # (N,)
        n_rows = z.shape[0]
        stats = torch.empty(3, n_rows, dtype=torch.float32, device=z.device)
        row_max, sum_exp, target_logit = stats.unbind(0)
        block, warps = _block(local_v)
        if n_rows:
            _row_max_kernel[(n_rows,)](z, row_max, local_v, BLOCK=block, num_warps=warps)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        if n_rows:
            _sum_exp_target_kernel[(n_rows,)](
                z,
                t,
                row_max,
                sum_exp,
                target_logit,
                local_v,
                vocab_start,
                BLOCK=block,
                num_warps=warps,
            )
        _all_reduce(stats[1:], dist.ReduceOp.SUM, group)  # sum_exp and target_logit at once
        loss = sum_exp.log() - target_logit

        ctx.save_for_backward(z, t, row_max, sum_exp)
        ctx.vocab_start = vocab_start
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        z, t, row_max, sum_exp = ctx.saved_tensors
        n_rows, local_v = z.shape
        dloss = grad_loss.contiguous().view(-1).to(torch.float32)  # (N,); may come expanded
        grad = torch.empty_like(z)
        block, warps = _block(local_v)
        if n_rows:
            _grad_kernel[(n_rows, triton.cdiv(local_v, block))](
                z,
                t,
                row_max,
                sum_exp,
                dloss,
                grad,
                local_v,
                ctx.vocab_start,
                BLOCK=block,
                num_warps=warps,
            )
        return grad.view(ctx.logits_shape), None, None


def vocab_parallel_cross_entropy_fused(
    logits: torch.Tensor, target: torch.Tensor, group=None
) -> torch.Tensor:
    """Per-token float32 loss (target's shape) from vocab-sharded `logits` (*, V/p).

    Rank r of `group` holds global vocab ids [r * V/p, (r + 1) * V/p); `target` holds global ids.
    """
    check_kernel_input(
        logits, "the cross-entropy kernel's logits", "torch_vocab_parallel_cross_entropy"
    )
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits (*, V/p) and target (*) disagree: {tuple(logits.shape)} vs "
            f"{tuple(target.shape)}"
        )
    return _FusedVocabParallelCrossEntropy.apply(logits, target, group)

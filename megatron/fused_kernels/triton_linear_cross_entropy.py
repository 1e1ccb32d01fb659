"""The elementwise part of the chunked linear + cross-entropy (megatron.mpu.linear_cross_entropy)
as Triton kernels: no fp32 copy of a chunk's logits, forward or backward.

The kernels are triton_cross_entropy's (the ones --cross-entropy-loss-fusion checks at build):
forward, this rank's row max and sum of exp(z - max) over a (rows, V/p) chunk in the logits'
dtype, fp32 math; backward, (exp(z - lse) - onehot) * dloss written in the logits' dtype in one
pass (the global log-sum-exp stands for the max, with a sum of 1).
"""

from __future__ import annotations

import torch

from megatron.fused_kernels._triton import check_kernel_input, triton
from megatron.fused_kernels.triton_cross_entropy import (
    _block,
    _grad_kernel,
    _row_max_kernel,
    _sum_exp_target_kernel,
)
from megatron.mpu.linear_cross_entropy import ChunkOps, local_targets


def _triton_stats(z: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """_torch_stats' contract: this rank's log-sum-exp and target logit (c,) fp32."""
    check_kernel_input(z, "the linear cross-entropy's logits", "TORCH_CHUNK_OPS")
    rows, cols = z.shape
    stats = torch.empty(3, rows, dtype=torch.float32, device=z.device)
    row_max, sum_exp, shifted_target = stats.unbind(0)
    block, warps = _block(cols)
    if rows:
        _row_max_kernel[(rows,)](z, row_max, cols, BLOCK=block, num_warps=warps)
        _sum_exp_target_kernel[(rows,)](
            z, target, row_max, sum_exp, shifted_target, cols, vocab_start,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    # A row of padding only (max -inf) has a sum of NaN: its log-sum-exp is -inf.
    lse = torch.where(row_max == float("-inf"), row_max, row_max + sum_exp.log())
    local, inside = local_targets(target, vocab_start, cols)
    z_t = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~inside, 0.0)
    return lse, z_t


def _triton_grad(z, target, vocab_start: int, lse: torch.Tensor, dloss: torch.Tensor):
    """_torch_grad's contract: (softmax(z) - onehot(target)) * dloss in z's dtype."""
    rows, cols = z.shape
    grad = torch.empty_like(z)
    ones = torch.ones_like(lse)  # exp(z - lse) is the softmax already
    block, warps = _block(cols)
    if rows:
        _grad_kernel[(rows, triton.cdiv(cols, block))](
            z, target, lse, ones, dloss, grad, cols, vocab_start, BLOCK=block, num_warps=warps
        )
    return grad


TRITON_CHUNK_OPS = ChunkOps("triton", _triton_stats, _triton_grad)

"""Scaled, masked softmax over the last dim of attention scores, as Triton kernels.

y = softmax(scale * x, with masked keys set to -inf); a row whose keys are all masked gives y = 0
(and a zero gradient) instead of NaN. Backward: dx = scale * y * (dy - sum(dy * y)); masked keys
have y = 0, so one backward kernel serves both the mask-tensor and the causal variant.

Math is in fp32 whatever the input dtype; y is stored in the input dtype. One program per row of
keys: a row of up to MAX_BLOCK keys is read once and kept in registers; a longer one is walked in
column blocks, an online max / sum-of-exps pass, then a normalising pass.
The module imports without Triton: the torch references are the fallback on such machines.
"""

from __future__ import annotations

import torch

from megatron.fused_kernels._triton import (
    check_kernel_input,
    tl,
    triton,
)
from megatron.fused_kernels._triton import jit as _jit

# Columns per loop step. Rows up to this long are read once per pass, longer ones loop; 4096 fp32
# values over 8 warps is 16 registers a thread. Tests lower it to exercise the loop.
MAX_BLOCK = 4096


@_jit
def _scaled_row_block(
    x_row,
    m_row,
    m_stride_k,
    cols,
    n_cols,
    last_key,
    scale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """scale * x for one block of a row in fp32, -inf where the key is masked or past the row."""
    keep = cols < n_cols
    if HAS_MASK:
        masked = tl.load(m_row + cols * m_stride_k, mask=keep, other=1)
        keep = keep & (masked == 0)
    if CAUSAL:
        keep = keep & (cols <= last_key)
    x = tl.load(x_row + cols, mask=keep, other=0.0).to(tl.float32)
    return tl.where(keep, x * scale, float("-inf"))


@_jit
def _softmax_fwd_kernel(
    x_ptr,
    y_ptr,
    mask_ptr,
    n_cols,
    sq,
    heads,
    m_stride_b,
    m_stride_h,
    m_stride_q,
    m_stride_k,
    causal_offset,
    scale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row = (b * heads + h) * sq + q
    q = row % sq
    bh = row // sq
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    # Broadcast mask dims have stride 0; without a mask these are all 0 and m_row is unused.
    m_row = mask_ptr + (bh // heads) * m_stride_b + (bh % heads) * m_stride_h + q * m_stride_q
    last_key = q + causal_offset  # causal: keys j > q + (sk - sq) are masked
    if ONE_BLOCK:  # the whole row stays in registers: read once
        cols = tl.arange(0, BLOCK)
        z = _scaled_row_block(
            x_row, m_row, m_stride_k, cols, n_cols, last_key, scale, HAS_MASK, CAUSAL
        )
        row_max = tl.max(z, 0)
        e = tl.exp(z - tl.where(row_max == float("-inf"), 0.0, row_max))  # all masked: 0s
        y = e * (1.0 / tl.maximum(tl.sum(e, 0), 1.0))
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        run_max = float("-inf")
        run_sum = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _scaled_row_block(
                x_row, m_row, m_stride_k, cols, n_cols, last_key, scale, HAS_MASK, CAUSAL
            )
            new_max = tl.maximum(run_max, tl.max(z, 0))
            # While every key so far is masked the max is -inf; shift by 0 then (all exps are 0).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift), 0)
            run_max = new_max
        shift = tl.where(run_max == float("-inf"), 0.0, run_max)
        # run_sum >= 1 (the max key contributes exp(0)) unless every key is masked; then it is 0 and
        # so is every exp, and the clamp turns 0/0 into 0.
        inv_sum = 1.0 / tl.maximum(run_sum, 1.0)

        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _scaled_row_block(
                x_row, m_row, m_stride_k, cols, n_cols, last_key, scale, HAS_MASK, CAUSAL
            )
            y = tl.exp(z - shift) * inv_sum
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@_jit
def _softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr, n_cols, scale, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * n_cols
    dy_row = dy_ptr + row * n_cols
    if ONE_BLOCK:  # the whole row stays in registers: read once
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        y = tl.load(y_row + cols, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)
        dx = scale * y * (dy - tl.sum(y * dy, 0))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=keep)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < n_cols
            y = tl.load(y_row + cols, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, 0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < n_cols
            y = tl.load(y_row + cols, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot)
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=keep)


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)
    return block, min(max(block // 256, 1), 8)


def _check(scores: torch.Tensor, min_dim: int) -> None:
    check_kernel_input(scores, "softmax kernels", "the torch_* reference functions")
    if scores.dim() < min_dim:
        raise ValueError(f"scores must have at least {min_dim} dims, got {tuple(scores.shape)}")


def _forward(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    scores = scores.contiguous()
    y = torch.empty_like(scores)
    if scores.numel() == 0:
        return y
    sq, sk = scores.shape[-2:]
    heads = scores.shape[-3] if mask is not None else 1
    if mask is None:  # causal or unmasked; any leading shape, rows are (..., sq)
        mask_arg, strides = scores, (0, 0, 0, 0)
    else:
        # (b, h, sq, sk) view of the mask with 0 strides on broadcast dims; bool as bytes
        expanded = mask.to(torch.bool).expand(scores.shape)
        mask_arg, strides = expanded.view(torch.uint8), expanded.stride()
    block, warps = _launch_config(sk)
    _softmax_fwd_kernel[(scores.numel() // sk,)](
        scores,
        y,
        mask_arg,
        sk,
        sq,
        heads,
        *strides,
        sk - sq,
        float(scale),
        HAS_MASK=mask is not None,
        CAUSAL=causal,
        BLOCK=block,
        ONE_BLOCK=sk <= block,
        num_warps=warps,
    )
    return y


def _backward(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    if y.numel() == 0:
        return dx
    sk = y.shape[-1]
    block, warps = _launch_config(sk)
    _softmax_bwd_kernel[(y.numel() // sk,)](
        y, dy, dx, sk, float(scale), BLOCK=block, ONE_BLOCK=sk <= block, num_warps=warps
    )
    return dx


class _ScaledSoftmax(torch.autograd.Function):
    """A mask tensor, or causal (mask computed in-kernel from the row and key indices)."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        y = _forward(scores, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _backward(y, dy, ctx.scale), None, None, None


def scaled_masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(scale * scores, masked keys -> -inf) over the last dim; fully masked rows -> 0.

    scores: (b, h, sq, sk); mask: bool broadcastable to it, typically (b or 1, 1, sq, sk),
    True = masked out; None = no mask (a plain scaled softmax).
    """
    _check(scores, 4)
    if scores.dim() != 4:
        raise ValueError(f"scores must be (b, h, sq, sk), got {tuple(scores.shape)}")
    return _ScaledSoftmax.apply(scores, mask, scale, False)


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of (..., sq, sk) scores: key j is masked for query i when j > i + sk - sq.

    With sq < sk the queries are the last sq positions (e.g. a new block after a KV prefix).
    """
    _check(scores, 2)
    return _ScaledSoftmax.apply(scores, None, scale, True)


def torch_scaled_masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Reference / fallback for `scaled_masked_softmax`: the same math in (at least) fp32."""
    z = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if mask is None:
        return torch.softmax(z, dim=-1).to(scores.dtype)
    z = z.masked_fill(mask, float("-inf"))
    # A fully masked row is NaN after softmax; zero it. Its gradient is zeroed by the backward of
    # the masked_fill above (a select, not a multiply), so no NaN reaches the scores either.
    y = torch.softmax(z, dim=-1).masked_fill(mask, 0.0)
    return y.to(scores.dtype)


def torch_scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference / fallback for `scaled_upper_triang_masked_softmax`."""
    sq, sk = scores.shape[-2:]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu_(sk - sq + 1)
    return torch_scaled_masked_softmax(scores, causal, scale)

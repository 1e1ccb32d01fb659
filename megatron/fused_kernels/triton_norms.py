"""Residual add fused with LayerNorm / RMSNorm, as Triton kernels.

h = x + residual (the new residual stream, in x's dtype; h = x when residual is None)
LayerNorm: y = (h - mean(h)) * rstd * w + b,  rstd = 1 / sqrt(var(h) + eps)
RMSNorm:   y = h * rstd * w,                   rstd = 1 / sqrt(mean(h^2) + eps)
Backward, with xhat = (h - mean) * rstd (mean = 0 for RMSNorm), N = row length and g = w * dy:
  dh = rstd * (g - xhat * mean(xhat * g) - mean(g)) + dh_in   (no mean(g) term for RMSNorm)
  dw = sum_rows(dy * xhat),  db = sum_rows(dy);  dx = dresidual = dh.

Statistics in fp32, y computed from h as rounded to its storage dtype (so y is exactly the norm
of the returned h). Forward and dh: one program per row, looping over column blocks. dw / db:
a second kernel over (row chunk, column block) tiles writes per-chunk partial sums, which torch
adds up (a (chunks, N) fp32 buffer, chunks <= 256).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused_kernels._triton import (  # noqa: F401 - HAS_TRITON re-exported
    HAS_TRITON,
    check_kernel_input,
    tl,
    triton,
)
from megatron.fused_kernels._triton import jit as _jit

# Columns per loop step of the row kernels (hidden sizes up to this are one block); tests lower it.
MAX_BLOCK = 4096
_DW_BLOCK_R, _DW_BLOCK_C, _DW_MAX_CHUNKS = 32, 128, 256


@_jit
def _load_h(x_row, r_row, cols, keep, HAS_RESIDUAL: tl.constexpr):
    """h = x + residual for one block, rounded to the storage dtype, returned in fp32."""
    h = tl.load(x_row + cols, mask=keep, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_row + cols, mask=keep, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h.to(tl.float32)


@_jit
def _norm_fwd_kernel(
    x_ptr,
    r_ptr,
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    r_row = r_ptr + row * n_cols
    mean = 0.0
    if not IS_RMS:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            acc += _load_h(x_row, r_row, cols, cols < n_cols, HAS_RESIDUAL)
        mean = tl.sum(acc, 0) / n_cols
        tl.store(mean_ptr + row, mean)

    # Two-pass variance (not E[h^2] - E[h]^2, which cancels badly); this pass also writes h.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        h = _load_h(x_row, r_row, cols, keep, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=keep)
        d = tl.where(keep, h - mean, 0.0)
        acc += d * d
    rstd = tl.rsqrt(tl.sum(acc, 0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)

    # h is recomputed from x and residual rather than read back from h_ptr: no store -> load
    # ordering to rely on within the program.
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        h = _load_h(x_row, r_row, cols, keep, HAS_RESIDUAL)
        y = (h - mean) * rstd * tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=keep)


@_jit
def _norm_bwd_dh_kernel(
    dy_ptr,
    h_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dh_in_ptr,
    dh_ptr,
    n_cols,
    HAS_DH_IN: tl.constexpr,
    IS_RMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dy_row = dy_ptr + row * n_cols
    h_row = h_ptr + row * n_cols
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)

    acc_xg = tl.zeros([BLOCK], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        h = tl.load(h_row + cols, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        g = w * tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)  # 0 off the row
        acc_xg += (h - mean) * rstd * g
        acc_g += g
    c_xg = tl.sum(acc_xg, 0) / n_cols
    c_g = 0.0
    if not IS_RMS:
        c_g = tl.sum(acc_g, 0) / n_cols

    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        h = tl.load(h_row + cols, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        g = w * tl.load(dy_row + cols, mask=keep, other=0.0).to(tl.float32)
        dh = rstd * (g - (h - mean) * rstd * c_xg - c_g)
        if HAS_DH_IN:
            dh += tl.load(dh_in_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(dh_ptr + row * n_cols + cols, dh.to(dh_ptr.dtype.element_ty), mask=keep)


@_jit
def _norm_bwd_dw_kernel(
    dy_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    chunk_rows,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Partial dw (and db) of rows [chunk * chunk_rows, +chunk_rows) for one column block."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_keep = cols < n_cols
    acc_w = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r in range(0, chunk_rows, BLOCK_R):  # chunk_rows is a multiple of BLOCK_R
        rows = chunk * chunk_rows + r + tl.arange(0, BLOCK_R)
        row_keep = rows < n_rows
        keep = row_keep[:, None] & col_keep[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]  # (BLOCK_R, BLOCK_C)
        dy = tl.load(dy_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_keep, other=0.0)
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_keep, other=0.0)
            xhat = (h - mean[:, None]) * rstd[:, None]
        acc_w += dy * xhat
        if HAS_BIAS:
            acc_b += dy
    tl.store(dw_part_ptr + chunk * n_cols + cols, tl.sum(acc_w, 0), mask=col_keep)
    if HAS_BIAS:
        tl.store(db_part_ptr + chunk * n_cols + cols, tl.sum(acc_b, 0), mask=col_keep)


def _row_launch_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    return block, min(max(block // 256, 1), 8)


def _weight_grads(dy, h, mean, rstd, has_bias, is_rms):
    """(dw, db) in fp32 from the per-chunk partial sums; db is None without a bias."""
    n_rows, n_cols = h.shape
    chunk_rows = triton.cdiv(n_rows, _DW_MAX_CHUNKS)
    chunk_rows = triton.cdiv(chunk_rows, _DW_BLOCK_R) * _DW_BLOCK_R
    chunks = triton.cdiv(n_rows, chunk_rows)
    dw_part = torch.empty(chunks, n_cols, dtype=torch.float32, device=h.device)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part
    grid = (chunks, triton.cdiv(n_cols, _DW_BLOCK_C))
    _norm_bwd_dw_kernel[grid](
        dy,
        h,
        mean,
        rstd,
        dw_part,
        db_part,
        n_rows,
        n_cols,
        chunk_rows,
        HAS_BIAS=has_bias,
        IS_RMS=is_rms,
        BLOCK_R=_DW_BLOCK_R,
        BLOCK_C=_DW_BLOCK_C,
    )
    return dw_part.sum(0), (db_part.sum(0) if has_bias else None)


class _AddNorm(torch.autograd.Function):
    """Outputs (y, h) with a residual, y alone without one (then h is x, left to the caller)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        ctx.set_materialize_grads(False)
        n_cols = x.shape[-1]
        x = x.contiguous()
        has_residual = residual is not None
        h = torch.empty_like(x) if has_residual else x
        y = torch.empty_like(x)
        n_rows = x.numel() // n_cols
        # mean is unused (never written or read) for RMSNorm; rstd is per row
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        if n_rows:
            block, warps = _row_launch_config(n_cols)
            _norm_fwd_kernel[(n_rows,)](
                x,
                residual.contiguous() if has_residual else x,
                h,
                weight,
                bias if bias is not None else weight,
                y,
                mean,
                rstd,
                n_cols,
                float(eps),
                HAS_RESIDUAL=has_residual,
                HAS_BIAS=bias is not None,
                IS_RMS=is_rms,
                BLOCK=block,
                num_warps=warps,
            )
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.flags = (has_residual, bias is not None, is_rms)
        ctx.weight_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return (y, h) if has_residual else y

    @staticmethod
    def backward(ctx, dy, dh_in=None):
        h, weight, mean, rstd = ctx.saved_tensors
        has_residual, has_bias, is_rms = ctx.flags
        n_cols = h.shape[-1]
        n_rows = h.numel() // n_cols
        if dy is None or n_rows == 0:  # y unused: only h's own gradient flows
            dh = torch.zeros_like(h) if dh_in is None else dh_in
            return dh, (dh if has_residual else None), None, None, None, None
        dy = dy.contiguous()
        dh = torch.empty_like(h)
        block, warps = _row_launch_config(n_cols)
        _norm_bwd_dh_kernel[(n_rows,)](
            dy,
            h,
            weight,
            mean,
            rstd,
            dy if dh_in is None else dh_in.contiguous(),
            dh,
            n_cols,
            HAS_DH_IN=dh_in is not None,
            IS_RMS=is_rms,
            BLOCK=block,
            num_warps=warps,
        )
        dw = db = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            dw, db = _weight_grads(
                dy.view(n_rows, n_cols), h.view(n_rows, n_cols), mean, rstd, has_bias, is_rms
            )
            dw = dw.to(ctx.weight_dtypes[0])
            db = None if db is None else db.to(ctx.weight_dtypes[1])
        return dh, (dh if has_residual else None), dw, db, None, None


def _check(x, residual, weight) -> None:
    check_kernel_input(x, "norm kernels", "the torch_* reference functions")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x: got {residual.dtype} {tuple(residual.shape)} "
            f"for x {x.dtype} {tuple(x.shape)}"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (or x), y = LayerNorm(h) * weight + bias over the last dim."""
    _check(x, residual, weight)
    out = _AddNorm.apply(x, residual, weight, bias, eps, False)
    return (out, x) if residual is None else out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (or x), y = h / sqrt(mean(h^2) + eps) * weight."""
    _check(x, residual, weight)
    out = _AddNorm.apply(x, residual, weight, None, eps, True)
    return (out, x) if residual is None else out


def torch_add_layer_norm(x, residual, weight, bias, eps):
    """Reference / fallback for `fused_add_layer_norm`: statistics in (at least) fp32."""
    h = x if residual is None else x + residual
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    b = None if bias is None else bias.to(hf.dtype)
    y = F.layer_norm(hf, hf.shape[-1:], weight.to(hf.dtype), b, eps)
    return y.to(x.dtype), h


def torch_add_rms_norm(x, residual, weight, eps):
    """Reference / fallback for `fused_add_rms_norm` (the math of model.transformer.RMSNorm)."""
    h = x if residual is None else x + residual
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(hf.dtype)).to(x.dtype), h

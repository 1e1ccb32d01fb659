"""Residual add fused with LayerNorm / RMSNorm, as Triton kernels.

h = x + residual (the new residual stream, in x's dtype; h = x when residual is None)
LayerNorm: y = (h - mean(h)) * rstd * w + b,  rstd = 1 / sqrt(var(h) + eps)
RMSNorm:   y = h * rstd * w,                   rstd = 1 / sqrt(mean(h^2) + eps)
Backward, with xhat = (h - mean) * rstd (mean = 0 for RMSNorm), N = row length and g = w * dy:
  dh = rstd * (g - xhat * mean(xhat * g) - mean(g)) + dh_in   (no mean(g) term for RMSNorm)
  dw = sum_rows(dy * xhat),  db = sum_rows(dy);  dx = dresidual = dh.

Statistics in fp32 (mean and rstd saved by the forward), y computed from h as rounded to its
storage dtype (so y is exactly the norm of the returned h). A row is one masked block of
next_power_of_2(N) columns, held in registers: every tensor is read once and written once.
Forward: each program takes ROWS rows. Backward: a fixed number of programs (a few per SM) each
walk a contiguous chunk of rows ROWS at a time, writing dh and keeping dw / db as fp32 partial
sums, one row of a (programs, N) buffer each, which one torch sum finishes (deterministic, no
atomics). ROWS and num_warps are autotuned per row width and dtype on the first call.
Rows wider than MAX_COLS take the torch twins (no model has such a hidden size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused_kernels._triton import (
    autotune,
    bounded_configs,
    check_kernel_input,
    config,
    reduction_programs,
    tl,
    triton,
)
from megatron.fused_kernels._triton import jit as _jit

MAX_COLS = 16384
_CONFIGS = [config(w, ROWS=r) for r in (1, 2, 4, 8, 16) for w in (2, 4, 8, 16)]


def _prune(per_thread):
    def prune(configs, named_args, **kwargs):
        block = {**named_args, **kwargs}["BLOCK_N"]
        return bounded_configs(configs, lambda c: c.kwargs["ROWS"] * block, per_thread=per_thread)

    return prune


@autotune(
    _CONFIGS,
    config(4, ROWS=2),
    key=["n_cols", "HAS_RESIDUAL", "HAS_BIAS", "IS_RMS"],
    prune=_prune((8, 32)),
)
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
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    keep = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    h = tl.load(x_ptr + offs, mask=keep, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=keep, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # rounded as torch's x + r
        tl.store(h_ptr + offs, h, mask=keep)
    xc = h.to(tl.float32)  # 0 off the tensor
    if not IS_RMS:
        mean = tl.sum(xc, axis=1) / n_cols
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        xc = tl.where(keep, xc - mean[:, None], 0.0)  # two-pass variance: no cancellation
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


@autotune(
    _CONFIGS,
    config(4, ROWS=2),
    key=["n_cols", "HAS_DH_IN", "HAS_BIAS", "IS_RMS"],
    prune=_prune((4, 16)),
)
@_jit
def _norm_bwd_kernel(
    dy_ptr,
    h_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dh_in_ptr,
    dh_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DH_IN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    """dh of rows [pid * rows_per_program, +rows_per_program), and their dw / db sums."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_N)
    acc_w = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < last
        keep = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=keep, other=0.0).to(tl.float32)  # 0 off the tensor
        xhat = tl.load(h_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if not IS_RMS:
            xhat -= tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        xhat *= rstd
        g = dy * w
        dh = g - xhat * (tl.sum(xhat * g, axis=1) / n_cols)[:, None]
        if not IS_RMS:
            dh -= (tl.sum(g, axis=1) / n_cols)[:, None]
        dh *= rstd
        if HAS_DH_IN:
            dh += tl.load(dh_in_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=keep)
        acc_w += dy * xhat
        if HAS_BIAS:
            acc_b += dy
    tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(acc_w, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid * n_cols + cols, tl.sum(acc_b, axis=0), mask=col_ok)


def _forward(x, residual, weight, bias, eps, is_rms):
    """(y, h, mean, rstd); mean is unused (never written or read) for RMSNorm."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    h = torch.empty_like(x) if residual is not None else x
    y = torch.empty_like(x)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows:
        _norm_fwd_kernel[lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)](
            x,
            x if residual is None else residual,
            h,
            weight,
            weight if bias is None else bias,
            y,
            mean,
            rstd,
            n_rows,
            n_cols,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None,
            IS_RMS=is_rms,
            BLOCK_N=triton.next_power_of_2(n_cols),
        )
    return y, h, mean, rstd


def _backward(dy, dh_in, h, weight, mean, rstd, has_bias, is_rms):
    """(dh, dw, db) with dw, db in fp32 (db None without a bias)."""
    n_cols = h.shape[-1]
    n_rows = h.numel() // n_cols
    per_program = triton.cdiv(n_rows, reduction_programs(h.device, per_sm=2))
    programs = triton.cdiv(n_rows, per_program)
    dh = torch.empty_like(h)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=h.device)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part
    _norm_bwd_kernel[(programs,)](
        dy,
        h,
        weight,
        mean,
        rstd,
        dy if dh_in is None else dh_in,
        dh,
        dw_part,
        db_part,
        n_rows,
        n_cols,
        per_program,
        HAS_DH_IN=dh_in is not None,
        HAS_BIAS=has_bias,
        IS_RMS=is_rms,
        BLOCK_N=triton.next_power_of_2(n_cols),
    )
    return dh, dw_part.sum(0), (db_part.sum(0) if has_bias else None)


class _AddNorm(torch.autograd.Function):
    """Outputs (y, h) with a residual, y alone without one (then h is x, left to the caller)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        ctx.set_materialize_grads(False)
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        y, h, mean, rstd = _forward(x, residual, weight, bias, eps, is_rms)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.flags = (residual is not None, bias is not None, is_rms)
        ctx.weight_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return (y, h) if residual is not None else y

    @staticmethod
    def backward(ctx, dy, dh_in=None):
        h, weight, mean, rstd = ctx.saved_tensors
        has_residual, has_bias, is_rms = ctx.flags
        if dy is None or h.numel() == 0:  # y unused: only h's own gradient flows
            dh = torch.zeros_like(h) if dh_in is None else dh_in
            return dh, (dh if has_residual else None), None, None, None, None
        dh_in = None if dh_in is None else dh_in.contiguous()
        dh, dw, db = _backward(dy.contiguous(), dh_in, h, weight, mean, rstd, has_bias, is_rms)
        dw = dw.to(ctx.weight_dtypes[0]) if ctx.needs_input_grad[2] else None
        db = db.to(ctx.weight_dtypes[1]) if db is not None and ctx.needs_input_grad[3] else None
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
    if x.shape[-1] > MAX_COLS:
        return torch_add_layer_norm(x, residual, weight, bias, eps)
    out = _AddNorm.apply(x, residual, weight, bias, eps, False)
    return (out, x) if residual is None else out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (or x), y = h / sqrt(mean(h^2) + eps) * weight."""
    _check(x, residual, weight)
    if x.shape[-1] > MAX_COLS:
        return torch_add_rms_norm(x, residual, weight, eps)
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

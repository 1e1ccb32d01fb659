"""MLP activations as Triton kernels: bias + exact GeLU, and SwiGLU.

bias_gelu: y = gelu(z), z = x + b, gelu(z) = z * Phi(z) (the erf form, F.gelu's default).
  Backward: dz = dy * (Phi(z) + z * phi(z)); dx = dz, db = sum_rows(dz).
  approximate="tanh" (--openai-gelu, F.gelu's tanh form): gelu(z) = z (1 + t) / 2 with
  t = tanh(k (z + c z^3)), k = sqrt(2 / pi), c = 0.044715;
  dz = dy * ((1 + t) / 2 + z (1 - t^2) k (1 + 3 c z^2) / 2).
swiglu: x = [gate | up] along the last dim, y = silu(gate) * up, silu(g) = g * sigmoid(g).
  Backward: dgate = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g); dup = dy * silu(g).

Elementwise math in fp32, outputs in the input dtype. Kernels work on (BLOCK_R, BLOCK_C) tiles of
the (rows, cols) view; the bias-gradient kernel walks a chunk of rows per program and writes a
per-chunk partial sum that torch adds up (a (chunks, cols) fp32 buffer, chunks <= 256).
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

# Columns per tile, and elements per tile (rows = TILE // columns); tests lower MAX_BLOCK.
MAX_BLOCK = 1024
TILE = 4096
_MAX_CHUNKS = 256


@_jit
def _tile(n_rows, n_cols, row_start, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(BLOCK_R, 1) int64 rows, (1, BLOCK_C) cols and the in-bounds mask of the tile at
    rows [row_start, +BLOCK_R) and column block program_id(1)."""
    rows = (row_start + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    return rows, cols, (rows < n_rows) & (cols < n_cols)


@_jit
def _tanh_gelu_t(z):
    """t = tanh(k (z + c z^3)) as 2 sigmoid(2u) - 1 (tanh is not in every Triton's tl.math)."""
    u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@_jit
def _bias_gelu_fwd_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TANH: tl.constexpr,
):
    rows, cols, keep = _tile(n_rows, n_cols, tl.program_id(0) * BLOCK_R, BLOCK_R, BLOCK_C)
    offs = rows * n_cols + cols
    z = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if TANH:
        y = 0.5 * z * (1.0 + _tanh_gelu_t(z))
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))  # erf(z / sqrt(2))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


@_jit
def _bias_gelu_bwd_kernel(
    x_ptr,
    b_ptr,
    dy_ptr,
    dx_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    chunk_rows,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TANH: tl.constexpr,
):
    """dx for rows [chunk * chunk_rows, +chunk_rows) of one column block, and their sum of dz."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bias = tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r in range(0, chunk_rows, BLOCK_R):  # chunk_rows is a multiple of BLOCK_R
        rows, tile_cols, keep = _tile(n_rows, n_cols, chunk * chunk_rows + r, BLOCK_R, BLOCK_C)
        offs = rows * n_cols + tile_cols
        z = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32) + bias[None, :]
        dy = tl.load(dy_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if TANH:
            t = _tanh_gelu_t(z)
            slope = 0.7978845608028654 * (1.0 + 0.134145 * z * z)  # k (1 + 3 c z^2)
            dz = dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * slope)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
            pdf = 0.3989422804014327 * tl.exp(-0.5 * z * z)  # exp(-z^2 / 2) / sqrt(2 pi)
            dz = dy * (cdf + z * pdf)  # 0 off the tensor (dy loaded as 0)
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=keep)
        acc += dz
    tl.store(db_part_ptr + chunk * n_cols + cols, tl.sum(acc, 0), mask=cols < n_cols)


@_jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, n_rows, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, keep = _tile(n_rows, f, tl.program_id(0) * BLOCK_R, BLOCK_R, BLOCK_C)
    offs = rows * f + cols  # into y / dy: (rows, f)
    x_offs = rows * (2 * f) + cols  # into x: (rows, 2f), gate at x_offs, up at x_offs + f
    g = tl.load(x_ptr + x_offs, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + x_offs + f, mask=keep, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


@_jit
def _swiglu_bwd_kernel(
    x_ptr, dy_ptr, dx_ptr, n_rows, f, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    rows, cols, keep = _tile(n_rows, f, tl.program_id(0) * BLOCK_R, BLOCK_R, BLOCK_C)
    offs = rows * f + cols
    x_offs = rows * (2 * f) + cols
    g = tl.load(x_ptr + x_offs, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + x_offs + f, mask=keep, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(dx_ptr + x_offs, dg.to(dx_ptr.dtype.element_ty), mask=keep)
    tl.store(dx_ptr + x_offs + f, du.to(dx_ptr.dtype.element_ty), mask=keep)


def _tile_shape(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    block_r = min(max(TILE // block_c, 1), triton.next_power_of_2(n_rows))
    return block_r, block_c


def _tile_grid(n_rows: int, n_cols: int):
    block_r, block_c = _tile_shape(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    return grid, {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": 8}


def _check(x: torch.Tensor) -> None:
    check_kernel_input(x, "activation kernels", "the torch_* reference functions")


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh: bool):
        x = x.contiguous()
        y = torch.empty_like(x)
        n_cols = x.shape[-1]
        n_rows = x.numel() // n_cols
        if n_rows:
            grid, meta = _tile_grid(n_rows, n_cols)
            _bias_gelu_fwd_kernel[grid](x, bias.contiguous(), y, n_rows, n_cols, TANH=tanh, **meta)
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dy = dy.contiguous()
        n_cols = x.shape[-1]
        n_rows = x.numel() // n_cols
        dx = torch.empty_like(x)
        block_r, block_c = _tile_shape(n_rows, n_cols)
        chunk_rows = triton.cdiv(triton.cdiv(n_rows, _MAX_CHUNKS), block_r) * block_r
        chunks = triton.cdiv(n_rows, chunk_rows)
        db_part = torch.zeros(chunks, n_cols, dtype=torch.float32, device=x.device)
        if n_rows:
            _bias_gelu_bwd_kernel[(chunks, triton.cdiv(n_cols, block_c))](
                x,
                bias.contiguous(),
                dy,
                dx,
                db_part,
                n_rows,
                n_cols,
                chunk_rows,
                BLOCK_R=block_r,
                BLOCK_C=block_c,
                TANH=ctx.tanh,
                num_warps=8,
            )
        return dx, db_part.sum(0).to(bias.dtype), None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        f = x.shape[-1] // 2
        y = x.new_empty(*x.shape[:-1], f)
        n_rows = y.numel() // f
        if n_rows:
            grid, meta = _tile_grid(n_rows, f)
            _swiglu_fwd_kernel[grid](x, y, n_rows, f, **meta)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        f = x.shape[-1] // 2
        dx = torch.empty_like(x)
        n_rows = dy.numel() // f
        if n_rows:
            grid, meta = _tile_grid(n_rows, f)
            _swiglu_bwd_kernel[grid](x, dy, dx, n_rows, f, **meta)
        return dx


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias); x (..., H), bias (H,). approximate: "none" (exact erf GeLU) or "tanh"
    (OpenAI's), as F.gelu's argument."""
    _check(x)
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"bias must be ({x.shape[-1]},), got {tuple(bias.shape)}")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _BiasGelu.apply(x, bias, approximate == "tanh")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x (..., 2f) = [gate | up] along the last dim; returns (..., f)."""
    _check(x)
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim ([gate | up]), got {tuple(x.shape)}")
    return _SwiGLU.apply(x)


def torch_bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none"):
    """Reference / fallback for `bias_gelu`: the add and the GeLU in (at least) fp32."""
    ct = torch.promote_types(x.dtype, torch.float32)
    return F.gelu(x.to(ct) + bias.to(ct), approximate=approximate).to(x.dtype)


def torch_swiglu(x: torch.Tensor) -> torch.Tensor:
    """Reference / fallback for `swiglu`, in (at least) fp32."""
    gate, up = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)

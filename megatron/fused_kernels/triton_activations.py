"""MLP activations as Triton kernels: bias + exact GeLU, and SwiGLU.

bias_gelu: y = gelu(z), z = x + b, gelu(z) = z * Phi(z) (the erf form, F.gelu's default).
  Backward: dz = dy * (Phi(z) + z * phi(z)); dx = dz, db = sum_rows(dz).
  approximate="tanh" (--openai-gelu, F.gelu's tanh form): gelu(z) = z (1 + t) / 2 with
  t = tanh(k (z + c z^3)), k = sqrt(2 / pi), c = 0.044715;
  dz = dy * ((1 + t) / 2 + z (1 - t^2) k (1 + 3 c z^2) / 2).
swiglu: x = [gate | up] along the last dim, y = silu(gate) * up, silu(g) = g * sigmoid(g).
  Backward: dgate = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g); dup = dy * silu(g).

Elementwise math in fp32, outputs in the input dtype. Kernels work on (BLOCK_R, BLOCK_C) tiles of
the (rows, cols) view, every tensor read once and written once; BLOCK_R and num_warps are
autotuned per row width and dtype on the first call. The backward of bias + GeLU runs a fixed
number of programs (one per SM) per column block, each walking a chunk of rows and keeping its
bias-gradient partial sum in fp32, one row of a (programs, cols) buffer that one torch sum
finishes (deterministic, no atomics).
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

# Columns per tile (narrower rows: next_power_of_2 of the row); tests lower it.
MAX_BLOCK = 1024
_CONFIGS = [config(w, BLOCK_R=r) for r in (1, 2, 4, 8, 16, 32) for w in (2, 4, 8, 16)]


def _tuned(key, per_thread=(8, 32)):
    """Autotuned over BLOCK_R and num_warps (BLOCK_C is the host's: _block_c), the tiles
    giving each thread `per_thread` values (fewer where the loop keeps accumulators)."""

    def prune(configs, named_args, **kwargs):
        block_c = {**named_args, **kwargs}["BLOCK_C"]
        return bounded_configs(
            configs, lambda c: c.kwargs["BLOCK_R"] * block_c, per_thread=per_thread
        )

    return autotune(_CONFIGS, config(4, BLOCK_R=4), key=key, prune=prune)


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


@_tuned(["n_cols", "TANH"])
@_jit
def _bias_gelu_fwd_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_cols,
    TANH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
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


@_tuned(["n_cols", "TANH"], per_thread=(4, 16))
@_jit
def _bias_gelu_bwd_kernel(
    x_ptr,
    b_ptr,
    dy_ptr,
    dx_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    TANH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """dx of rows [pid * rows_per_program, +rows_per_program) in one column block, and their
    sum of dz (this program's row of the partial bias gradient)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bias = tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, BLOCK_R):
        rows, tile_cols, keep = _tile(last, n_cols, start, BLOCK_R, BLOCK_C)
        offs = rows * n_cols + tile_cols
        z = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32) + bias
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
    tl.store(db_part_ptr + pid * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols)


@_tuned(["f"])
@_jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, n_rows, f, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    rows, cols, keep = _tile(n_rows, f, tl.program_id(0) * BLOCK_R, BLOCK_R, BLOCK_C)
    offs = rows * f + cols  # into y / dy: (rows, f)
    x_offs = rows * (2 * f) + cols  # into x: (rows, 2f), gate at x_offs, up at x_offs + f
    g = tl.load(x_ptr + x_offs, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + x_offs + f, mask=keep, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


@_tuned(["f"])
@_jit
def _swiglu_bwd_kernel(
    x_ptr, dy_ptr, dx_ptr, n_rows, f, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr
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


def _block_c(n_cols: int) -> int:
    return min(triton.next_power_of_2(n_cols), MAX_BLOCK)


def _tile_grid(n_rows: int, n_cols: int):
    """The grid of a (BLOCK_R, BLOCK_C) tiling of (n_rows, n_cols); BLOCK_R is autotuned."""
    block_c = _block_c(n_cols)
    return lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]), triton.cdiv(n_cols, block_c))


def _check(x: torch.Tensor) -> None:
    check_kernel_input(x, "activation kernels", "the torch_* reference functions")


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh: bool):
        x, bias = x.contiguous(), bias.contiguous()
        y = torch.empty_like(x)
        n_cols = x.shape[-1]
        n_rows = x.numel() // n_cols
        if n_rows:
            _bias_gelu_fwd_kernel[_tile_grid(n_rows, n_cols)](
                x, bias, y, n_rows, n_cols, TANH=tanh, BLOCK_C=_block_c(n_cols)
            )
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
        if not n_rows:
            return dx, torch.zeros_like(bias), None
        per_program = triton.cdiv(n_rows, reduction_programs(x.device))
        programs = triton.cdiv(n_rows, per_program)
        db_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
        block_c = _block_c(n_cols)
        _bias_gelu_bwd_kernel[(programs, triton.cdiv(n_cols, block_c))](
            x,
            bias,
            dy,
            dx,
            db_part,
            n_rows,
            n_cols,
            per_program,
            TANH=ctx.tanh,
            BLOCK_C=block_c,
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
            _swiglu_fwd_kernel[_tile_grid(n_rows, f)](x, y, n_rows, f, BLOCK_C=_block_c(f))
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
            _swiglu_bwd_kernel[_tile_grid(n_rows, f)](x, dy, dx, n_rows, f, BLOCK_C=_block_c(f))
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

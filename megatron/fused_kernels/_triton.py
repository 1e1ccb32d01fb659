"""What every kernel module shares: Triton if it is installed, and the input check.

The modules import without Triton (their torch references still work); calling a kernel then
raises a clear error.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton, tl = None, None

HAS_TRITON = triton is not None
jit = triton.jit if HAS_TRITON else (lambda fn: fn)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_kernel_input(t: torch.Tensor, what: str, fallback: str) -> None:
    """Triton present and `t` in a dtype the kernels take; `fallback` names the torch twin."""
    if not HAS_TRITON:
        raise RuntimeError(f"Triton is not installed; use {fallback}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{what} take fp32/bf16/fp16 inputs, got {t.dtype}")

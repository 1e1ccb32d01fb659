"""Liger-Kernel's Triton ops behind our ops' signatures (--kernel-library liger).

Liger-Kernel (PyPI `liger-kernel`, tested with 0.8.5; pure Triton, installed without its
dependencies) has LayerNorm, RMSNorm, a residual add fused with RMSNorm, and SwiGLU over a
[gate | up] tensor. Each is called here in the mode that computes our torch twin's math: fp32
statistics and products, one rounding to the input dtype (Liger's "gemma" casting mode), and
never in place (its in-place backward would overwrite a gradient the model still reads).

Liger has no residual add fused with LayerNorm: h = x + residual runs in torch (one more read of
x and residual than our fused kernel), then Liger's LayerNorm. It has no bias + GeLU (its GeGLU
is the gated gelu(gate) * up, not this model's MLP): that op stays ours.
"""

from __future__ import annotations

import importlib.util

import torch

TESTED_VERSION = "0.8.5"
OPS = ("add_norm", "swiglu")  # what --kernel-library liger takes from Liger; the rest stay ours


def missing_reason() -> str | None:
    """None when Liger-Kernel imports; else why not, with the fix."""
    if importlib.util.find_spec("liger_kernel") is None:
        return (
            "--kernel-library liger needs the liger-kernel package, which is not installed. "
            f"Fix: pip install --no-deps liger-kernel=={TESTED_VERSION} (or pip install "
            "'megatron-3d[liger]'), or use --kernel-library ours"
        )
    return None


def add_layer_norm(x, residual, weight, bias, eps):
    """(y, h): h = x + residual (torch; x when residual is None), y = Liger's LayerNorm(h)."""
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    h = x if residual is None else x + residual
    if bias is None:  # Liger's kernel always reads a bias
        bias = torch.zeros_like(weight)
    return LigerLayerNormFunction.apply(h, weight, bias, eps), h


def add_rms_norm(x, residual, weight, eps):
    """(y, h): Liger's fused residual add + RMSNorm (RMSNorm alone when residual is None)."""
    if residual is None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "gemma", False), x
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    y, h = LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "gemma", False)
    return y, h


def swiglu(x):
    """silu(gate) * up for x = [gate | up] along the last dim, Liger's fused gate-up kernel."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    # 2-D in and out: Liger 0.8.5's backward returns the gradient flattened to (rows, 2f), which
    # autograd rejects for a 3-D x; the views around it carry the shape instead.
    y = LigerFusedGateUpSiLUMulFunction.apply(x.reshape(-1, x.shape[-1]), False)
    return y.view(*x.shape[:-1], y.shape[-1])

"""The torch implementations of the fused ops: the fallback everywhere Triton cannot run, and
the reference the kernels are tested against. Pure torch; importing this never needs Triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale x scores) over keys j <= i + (s_k - s_q) (causal, queries at the end)."""
    sq, sk = scores.shape[-2], scores.shape[-1]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
    x = (scores.float() * scale).masked_fill(~keep, float("-inf"))
    return x.softmax(dim=-1).to(scores.dtype)


def torch_scaled_masked_softmax(scores, mask, scale):
    """softmax(scale x scores) with masked (True) positions excluded; all-masked rows give 0."""
    x = (scores.float() * scale).masked_fill(mask, float("-inf"))
    probs = x.softmax(dim=-1).nan_to_num(0.0)
    return probs.to(scores.dtype)


def torch_add_layer_norm(x, residual, weight, bias, eps):
    """(layer_norm(x + residual), x + residual)."""
    h = x if residual is None else x + residual
    return F.layer_norm(h, (h.size(-1),), weight, bias, eps), h


def torch_add_rms_norm(x, residual, weight, eps):
    """(rms_norm(x + residual) * weight, x + residual), computed in float32 (or wider)."""
    h = x if residual is None else x + residual
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(hf.dtype)
    return y.to(h.dtype), h


def torch_bias_gelu(x, bias):
    return F.gelu(x + bias)


def torch_swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

"""Rotary position embeddings: RoPE in the rotate-half layout, and YaRN's scaled frequencies
(multi-latent attention, megatron.model.attention.mla).

YaRN (Peng et al. 2023, as Megatron-core's YarnRotaryEmbedding and HF's rope_type "yarn"): each
frequency f_i = base^(-2i/d) is blended between itself (extrapolation, fast-turning dimensions)
and f_i / s (interpolation, slow ones) by a ramp over the dimensions whose number of turns in
the original context lies between beta_slow and beta_fast; cos and sin are multiplied by the
attention factor m(s, mscale) / m(s, mscale_all_dim), m(s, x) = 0.1 x ln s + 1 (1 when s <= 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """m(s, x) = 0.1 x ln s + 1, or 1 when s <= 1 (no extension)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(turns: float, dim: int, base: float, original: int) -> float:
    """The dimension whose frequency turns `turns` times over `original` positions."""
    return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, factor: float, original: int, fast: float, slow: float):
    """(dim / 2,) float64 inverse frequencies of YaRN: extrapolated below the ramp, divided
    by `factor` above it, blended linearly over it (rounded bounds, as both references)."""
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inter = extra / factor
    low = max(math.floor(_correction_dim(fast, dim, base, original)), 0)
    high = min(math.ceil(_correction_dim(slow, dim, base, original)), dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return inter * (1 - keep) + extra * keep


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout (as Megatron-core and HF Llama): the pair (i, i + d/2).

    `inv_freq` (d / 2,) replaces base^(-2i/d) (YaRN's) and `attention_factor` multiplies the
    cos / sin tables (YaRN's mscale)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        device=None,
        dtype=None,
        inv_freq: torch.Tensor | None = None,
        attention_factor: float = 1.0,
    ):
        super().__init__()
        # Angles in float64; tables kept in float32 (or the model dtype when that is wider).
        table_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        if inv_freq is None:
            inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_positions, d)
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        self.register_buffer("cos", cos.to(device, table_dtype), persistent=False)
        self.register_buffer("sin", sin.to(device, table_dtype), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # x: (b, s, n, d); position_ids: (b, s)
        cos = self.cos[position_ids].unsqueeze(2).to(x.dtype)  # (b, s, 1, d)
        sin = self.sin[position_ids].unsqueeze(2).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

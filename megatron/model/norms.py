"""The norms of the transformer layers: LayerNorm (torch's) and RMSNorm, chosen by
--normalization."""

from __future__ import annotations

import torch
from torch import nn

from megatron.config.schema import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (or wider)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


NORM_TYPES = (nn.LayerNorm, RMSNorm)


def build_norm(cfg: ModelConfig, device=None, dtype=None, size: int | None = None) -> nn.Module:
    """--normalization's norm over `size` features (default: the hidden size)."""
    size = cfg.hidden_size if size is None else size
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size, cfg.layernorm_epsilon, device=device, dtype=dtype)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)

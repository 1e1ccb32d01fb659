"""The torch path of the fused ops the model calls either way (used wherever Triton is not):
the model's own math in the input dtype. Pure torch; importing this never needs Triton. (The
kernels' tests compare against the float32-accumulating twins in each triton_* module.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale x scores) over keys j <= i + (s_k - s_q) (causal, queries at the end)."""
    sq, sk = scores.shape[-2], scores.shape[-1]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
    x = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    return x.masked_fill(~keep, float("-inf")).softmax(dim=-1).to(scores.dtype)


def torch_scaled_masked_softmax(
    scores: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(scale x scores) over the keys where `keep` is True (every row keeps one or more).

    With keep = the causal mask this is torch_scaled_upper_triang_masked_softmax, bit for bit."""
    x = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    return x.masked_fill(~keep, float("-inf")).softmax(dim=-1).to(scores.dtype)


def torch_swiglu(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

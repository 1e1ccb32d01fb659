"""The KV cache of a windowed layer (--window-size) in generation: only the last LEFT positions
are kept between steps, so its memory is bounded by the window, not by the context; global
layers keep PrefixCache's full one.

It has PrefixCache's interface (`length`: every position seen, which RoPE counts from;
`extend(k, v, mask)`), so multi-head / grouped-query attention (keys and values) and
multi-latent attention (latents) take it alike. A step's keys are the kept ones, then the step's
own: the same relative positions as the full cache's last ones, so the core's window mask
(window.py) sees exactly the keys the full cache would let it see.
"""

from __future__ import annotations

import torch

from megatron.model.attention.masks import CAUSAL, AttentionMask, causal_keep


class RollingCache:
    """The last `left` positions' two tensors (b, <= left, ...) for one windowed layer."""

    def __init__(self, left: int):
        self.left, self.length = left, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask):
        """(the kept positions' k and v then this step's s, the mask of the s new queries)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        s, m = k.size(1) - (0 if self.k is None else self.k.size(1)), k.size(1)
        keep = min(m, self.left)  # cloned: a view would hold the step's whole tensor
        self.k, self.v = k[:, m - keep :].clone(), v[:, m - keep :].clone()
        self.length += s
        if s == m or s == 1:  # causal: from the start, or one query that sees every kept key
            return k, v, CAUSAL
        return k, v, AttentionMask.arbitrary(causal_keep(s, m, k.device)[0, 0])

    @property
    def held(self) -> int:
        """Positions held between steps (at most `left`)."""
        return 0 if self.k is None else self.k.size(1)

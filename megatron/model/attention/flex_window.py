"""Flex attention's sliding window on CUDA: a backend that runs a causal WINDOW mask (window.py)
through torch's flex_attention with a block mask, compiled once per process, so the key blocks
wholly outside every query's window are skipped (never scored). Asked after flash-attn's window
(window.py) and before SDPA's boolean mask; it takes no dropout (flex has none) and no sink.
The block mask is built once per (queries, keys, LEFT, device) and reused by every layer."""

from __future__ import annotations

import functools

import torch

from megatron.model.attention.backends import AttentionBackend, register_backend
from megatron.model.attention.window import WINDOW


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def window_block_mask(s_q: int, s_k: int, left: int, device: str):
    """The block mask of queries at the last s_q of s_k positions, each seeing itself and the
    `left` keys before it."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = s_k - s_q

    def inside(b, h, q, kv):
        return (kv <= q + offset) & (q + offset - kv <= left)

    return create_block_mask(inside, None, None, s_q, s_k, device=device)


_COMPILED = {}


def _flex(device_type: str):
    """flex_attention, compiled on CUDA (its fast path); eager elsewhere (the CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["fn"]


def no_dropout(core) -> bool:
    return core.dropout == 0 or not core.training


class FlexWindowBackend(AttentionBackend):
    name, grouped_kv = "flex-window", True

    def accepts(self, core, mask, q):
        if mask.type is not WINDOW or not mask.data.base.type.causal or not q.is_cuda:
            return False
        if core.ops.attention_backend != "sdpa" or core.fp32_softmax(q.dtype):
            return False
        return core.softmax_type == "vanilla" and no_dropout(core) and flex_available()

    def attend(self, core, q, k, v, mask, p):
        block = window_block_mask(q.size(2), k.size(2), mask.data.left, str(q.device))
        grouped = k.size(1) < q.size(1)
        flex = _flex(q.device.type)
        return flex(q, k, v, block_mask=block, scale=core.softmax_scale, enable_gqa=grouped)


FLEX_WINDOW = register_backend(FlexWindowBackend(), priority=60)

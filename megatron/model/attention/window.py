"""Sliding-window attention (--window-size): a mask kind that narrows another mask to the
LEFT keys before each query, and the kernel choice for it.

WINDOW carries the mask it narrows (`base`: causal, a packed sample's documents, a KV-cache
prefix) and LEFT: query i (at position p_i, the queries being the last s_q of s_k positions)
sees key j where the base lets it and p_i - LEFT <= j. A document's window thus stops at the
document's start. Every backend runs its dense form (SDPA's boolean mask on the CPU); on CUDA,
a causal window in half precision runs flash-attn's `window_size` when flash-attn is
installed, else flex attention's block mask (flex_window.py) without dropout: both skip the
blocks outside the window. The ring (context parallelism) takes no
window: megatron.config.rules_window refuses the pair before any work.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from megatron.model.attention.backends import AttentionBackend, register_backend
from megatron.model.attention.masks import AttentionMask, MaskKind, register_mask_kind


@dataclass(frozen=True)
class Window:
    """What a WINDOW mask carries: the mask it narrows and the keys each query sees back."""

    base: AttentionMask
    left: int


def window_keep(s_q: int, s_k: int, left: int, device) -> torch.Tensor:
    """(1, 1, s_q, s_k) bool: query i (at position s_k - s_q + i) sees keys at most `left`
    positions back (and, of itself, nothing ahead: that is the base mask's)."""
    q = torch.arange(s_k - s_q, s_k, device=device).unsqueeze(1)
    return (torch.arange(s_k, device=device).unsqueeze(0) >= q - left).view(1, 1, s_q, s_k)


class _Window(MaskKind):
    name, data = "window", "a window"

    def keep(self, mask, s_q, s_k, device):
        window: Window = mask.data
        base = window.base.dense(s_q, s_k, device)
        return base & window_keep(s_q, s_k, window.left, device)

    def ring_documents(self, mask):
        raise ValueError(
            "ring attention (--context-parallel-size > 1) does not apply a --window-size "
            "window; megatron.config.rules_window refuses the pair"
        )


WINDOW = register_mask_kind(_Window())


def windowed(mask: AttentionMask, left: int) -> AttentionMask:
    """`mask` narrowed to the `left` keys before each query."""
    return AttentionMask(WINDOW, data=Window(mask, left))


def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class FlashWindowBackend(AttentionBackend):
    """flash-attn's causal kernel with window_size=(LEFT, 0), where it runs: CUDA, fp16/bf16,
    a causal base mask with as many queries as keys, the plain SDPA path (no fp32-softmax
    flags) and no sink. It skips the key blocks wholly outside every query's window."""

    name, grouped_kv = "flash-window", True

    def accepts(self, core, mask, q):
        if mask.type is not WINDOW or not mask.data.base.type.causal:
            return False
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        if core.ops.attention_backend != "sdpa" or core.fp32_softmax(q.dtype):
            return False
        return getattr(core, "sink", None) is None and has_flash_attn()

    def attend(self, core, q, k, v, mask, p):
        from flash_attn import flash_attn_func  # checked by accepts

        # flash-attn (>= 2.1) aligns the causal mask to the last keys, as masks.py does
        out = flash_attn_func(
            *(t.transpose(1, 2) for t in (q, k, v)),  # (b, s, heads, d)
            dropout_p=p,
            softmax_scale=core.softmax_scale,
            causal=True,
            window_size=(mask.data.left, 0),
        )
        return out.transpose(1, 2)


FLASH_WINDOW = register_backend(FlashWindowBackend(), priority=50)


def window_report(m, device, dtype, ops) -> list[str]:
    """The build log's lines for the windowed layers' kernel and the sinks (`m` a ModelConfig,
    `ops` its FusedOps); none for a model without either."""
    lines = []
    if m.window is not None:
        left, path = m.window[0], ops.attention_backend
        half = dtype in (torch.float16, torch.bfloat16)
        if m.softmax_type != "vanilla":
            kernel = "the window mask in the sink backend's explicit softmax"
        elif torch.device(device).type == "cuda" and path == "sdpa":
            if has_flash_attn() and half:
                kernel = f"flash-attn window_size=({left}, 0), the blocks outside it skipped"
            elif m.attention_dropout == 0:
                kernel = (
                    "flex attention's window block mask (compiled), the blocks outside it skipped"
                )
            else:  # flex takes no dropout
                kernel = "SDPA with a boolean window mask (flex attention takes no dropout)"
        else:
            kernel = f"the dense window mask in the {path} path"
        layers = sum(m.window_layers)
        lines.append(f"window attention: {layers} of {m.num_layers} layers, LEFT {left}: {kernel}")
    if m.softmax_type != "vanilla":
        lines.append(
            f"attention sinks (--softmax-type {m.softmax_type}): the sink backend's explicit "
            "fp32 softmax with one extra logit per row"
        )
    return lines

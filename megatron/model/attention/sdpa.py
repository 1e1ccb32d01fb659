"""Torch SDPA as an attention backend (every mask kind: is_causal, or the kind's boolean mask),
and --sdpa-backend: which kernel torch's scaled_dot_product_attention runs, and which it chose.

SDPA dispatches to one of four kernels: cuDNN attention, FlashAttention-2, memory-efficient
(xformers-style) or the math reference. Each runs only some inputs (dtype, head size, mask,
device), and torch takes the first in its priority order that can. `auto` puts cuDNN first
(the fastest for bf16 on an H100), then flash, efficient and math; a named backend is the only
one allowed. `sdpa_context` wraps every SDPA call of the model; `sdpa_choice` asks torch's own
dispatcher which kernel a call of given shapes would run, so the log names the kernel that runs.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.model.attention.backends import AttentionBackend, register_backend

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
AUTO_ORDER = ("cudnn", "flash", "efficient", "math")
# sdpa_kernel(backends, set_priority=True) orders the backends (torch >= 2.6); without it, auto
# is torch's default order.
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def sdpa_context(backend: str):
    """The context SDPA runs in for --sdpa-backend `backend` (a named one alone; auto: all of
    them, cuDNN first)."""
    if backend == "auto":
        if not _HAS_PRIORITY:
            return contextlib.nullcontext()
        return sdpa_kernel([BACKENDS[name] for name in AUTO_ORDER], set_priority=True)
    return sdpa_kernel(BACKENDS[backend])


class SdpaBackend(AttentionBackend):
    """The default: torch SDPA under --sdpa-backend's kernel. PyTorch's flash kernels (CPU and
    CUDA) take equal head sizes only, and would otherwise fall back to the score matrix: the
    core pads narrower values (MLA's) with zeros, which changes no score and no output (as
    Transformer Engine pads MLA for flash attention)."""

    name, equal_head_dims = "sdpa", True

    def accepts(self, core, mask, q):
        return True

    def attend(self, core, q, k, v, mask, p):
        with sdpa_context(core.ops.sdpa_backend):  # --sdpa-backend's kernel
            if not mask.type.causal:
                keep = mask.dense(q.size(2), k.size(2), q.device)
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=keep, dropout_p=p, scale=core.softmax_scale
                )
            # one query at the end of the keys sees them all; SDPA's is_causal aligns the
            # queries to the start: right only when s_q == s_k (KV caches with several new
            # queries pass an ARBITRARY mask)
            causal = q.size(2) > 1
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=causal, scale=core.softmax_scale
            )


SDPA = register_backend(SdpaBackend(), priority=100)


def sdpa_choice(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> str | None:
    """The kernel SDPA would run for these inputs under --sdpa-backend `backend` (cudnn,
    flash, efficient or math), or None when no allowed one can. Nothing is computed."""
    try:
        with sdpa_context(backend):
            index = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal)
    except RuntimeError:  # "No viable backend" (the CPU dispatcher raises; CUDA's says ERROR)
        return None
    names = {int(b): name for name, b in BACKENDS.items()}
    return names.get(int(index))


def sdpa_report(
    backend: str, heads: int, seq: int, head_dim: int, dtype, device, dropout: float = 0.0
) -> str:
    """The log line for a model's causal self-attention (batch 1 probes the same kernel as
    any batch). Raises ValueError when the named backend cannot run it."""
    q = torch.empty(1, heads, seq, head_dim, dtype=dtype, device=device)  # (b, heads, s, d)
    chosen = sdpa_choice(backend, q, q, q, dropout_p=dropout, is_causal=True)
    shape = f"(b, {heads}, {seq}, {head_dim}) {str(dtype).removeprefix('torch.')} causal"
    if chosen is None:
        raise ValueError(
            f"--sdpa-backend {backend} cannot run this model's attention {shape} on {device}. "
            "Fix: --sdpa-backend auto (the first backend that can)"
        )
    if backend == "auto":
        order = ", ".join(AUTO_ORDER) if _HAS_PRIORITY else "torch's default order"
        return f"SDPA backend: {chosen} (auto: the first of {order} that runs {shape})"
    return f"SDPA backend: {chosen} (--sdpa-backend {backend}, {shape})"


def attention_report(m, ops, state, dtype, device) -> str | None:
    """The SDPA line of a model's build log (`m` a ModelConfig, `ops` its FusedOps), or None
    where the attention core is not SDPA's. Raises ValueError as `sdpa_report`."""
    half = dtype in (torch.float16, torch.bfloat16)
    fp32_softmax = half and (ops.softmax_in_fp32 or m.apply_query_key_layer_scaling)
    if ops.attention_backend != "sdpa" or fp32_softmax:
        return None
    if state.cp_size > 1:
        return "SDPA backend: ring attention's blocks pick theirs (--context-parallel-size > 1)"
    heads = m.num_attention_heads // state.tp_size  # this TP rank's heads
    head_dim = m.head_dim
    if m.multi_latent_attention:  # queries and keys, and the values padded to them
        head_dim = max(m.qk_nope_dim + m.qk_rope_dim, m.v_dim)
    return sdpa_report(
        ops.sdpa_backend, heads, m.seq_length, head_dim, dtype, device, m.attention_dropout
    )

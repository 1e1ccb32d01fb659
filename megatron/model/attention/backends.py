"""The kernels that compute a core attention, and the chooser that picks one per call.

A backend is an AttentionBackend in its own file (ring.py, softmax.py, sdpa.py), registered
with a priority: `choose_backend` asks them in priority order (lowest first) and takes the
first whose `accepts(core, mask, q)` is true. The built-in order: the ring under context
parallelism (0), attention sinks (sinks.py, 5), the explicit masked softmax of
--attention-backend fused / unfused and the v1.x fp32-softmax flags (10), the CUDA varlen kernels
of packed documents (40, varlen_cuda.py), SDPA once per document (50, varlen_sdpa.py),
flash-attn's sliding window on CUDA (window.py, 50), flex attention's (flex_window.py, 60),
torch SDPA, which runs every mask kind (100).
"""

from __future__ import annotations

import torch

from megatron.model.attention.masks import AttentionMask


class AttentionBackend:
    """softmax(scale q k^T, masked) v with dropout p, for q (b, heads, s_q, d) and k, v
    (b, heads, s_k, d) (or (b, groups, s_k, d) where `grouped_kv`: the backend shares each
    key/value head among heads / groups queries itself). `equal_head_dims`: its kernels want
    the values' head size equal to the queries' (the core pads narrower values with zeros)."""

    name: str = ""
    grouped_kv: bool = False
    equal_head_dims: bool = False

    def accepts(self, core, mask: AttentionMask, q: torch.Tensor) -> bool:
        raise NotImplementedError

    def attend(self, core, q, k, v, mask: AttentionMask, p: float) -> torch.Tensor:
        """(b, heads, s_q, d_v); `core` (core.CoreAttention) gives the scale, the ops and the
        ring. Dropout draws from the current generator (the core forks the RNG tracker)."""
        raise NotImplementedError


_BACKENDS: list[tuple[int, AttentionBackend]] = []


def register_backend(backend: AttentionBackend, priority: int) -> AttentionBackend:
    """Add `backend` to those `choose_backend` asks, before any of a higher priority number."""
    if any(b.name == backend.name for _, b in _BACKENDS):
        raise ValueError(f"attention backend {backend.name!r} is registered already")
    _BACKENDS.append((priority, backend))
    _BACKENDS.sort(key=lambda entry: entry[0])
    return backend


def unregister_backend(backend: AttentionBackend) -> None:
    """Remove `backend` from those `choose_backend` asks."""
    _BACKENDS[:] = [entry for entry in _BACKENDS if entry[1] is not backend]


def backend_names() -> list[str]:
    """The registered backends, in the order they are asked."""
    return [b.name for _, b in _BACKENDS]


def choose_backend(core, mask: AttentionMask, q: torch.Tensor) -> AttentionBackend:
    """The first registered backend that runs `mask` for these queries in `core`."""
    for _, backend in _BACKENDS:
        if backend.accepts(core, mask, q):
            return backend
    raise ValueError(f"no attention backend runs a {mask.type.name} mask here")

"""The core attention every self-attention variant builds and owns: softmax(scale q k^T, mask) v
over this rank's heads, with attention dropout, recompute of the core in backward
(--recompute-granularity selective) and the ring under context parallelism; the backend that
runs it is picked per call from the mask and the settings (backends.py). Also what the variants
share around it: the base of their KV caches, and SelfAttention, which builds the core and
the output projection (standard.py: multi-head / grouped-query; mla.py: multi-latent).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.attention import flex_window as _flex  # noqa: F401  (registers it)
from megatron.model.attention import ring as _ring  # noqa: F401  (registers the backend)
from megatron.model.attention import sdpa as _sdpa  # noqa: F401  (registers the backend)
from megatron.model.attention import softmax as _softmax  # noqa: F401  (registers the backend)
from megatron.model.attention import varlen_cuda as _varlen  # noqa: F401  (registers 2 backends)
from megatron.model.attention.backends import choose_backend
from megatron.model.attention.masks import CAUSAL, AttentionMask, causal_keep
from megatron.model.attention.sinks import learnable_sink
from megatron.model.attention.window import windowed
from megatron.model.context import BuildContext
from megatron.mpu import RowParallelLinear, checkpoint
from megatron.mpu.context_parallel import RingAttention


class CoreAttention(nn.Module):
    """q (b, heads, s_q, d), k (b, groups, s_k, d), v (b, groups, s_k, d_v) -> (b, heads, s_q,
    d_v); s_q < s_k only for a KV cache's queries, which are the last s_q positions.

    `softmax_scale`: None for 1 / sqrt(d). `qk_coeff`: L of --apply-query-key-layer-scaling,
    scores q k^T / (sqrt(d) L) from the GEMM, softmax(L x scores) in fp32 (v1.x's fp16 overflow
    guard; equal in exact math). `recompute`: recompute the core in backward (set by
    megatron.model.parallelize for --recompute-granularity selective). `window`: LEFT of a
    windowed layer (window.py: each query sees the LEFT keys before it), None: global.
    `softmax_type`: --softmax-type (sinks.py), `heads` this rank's query heads (a learnable
    sink's logits)."""

    def __init__(
        self,
        ctx: BuildContext,
        dropout: float,
        softmax_scale: float | None = None,
        qk_coeff: float | None = None,
        window: int | None = None,
        softmax_type: str = "vanilla",
        heads: int = 1,
    ):
        super().__init__()
        self.ops, self.rng_tracker = ctx.ops, ctx.rng_tracker
        self.dropout, self.softmax_scale, self.qk_coeff = dropout, softmax_scale, qk_coeff
        self.recompute = False
        self.window, self.softmax_type = window, softmax_type
        if softmax_type == "learnable":
            self.softmax_offset = learnable_sink(heads, ctx)  # (heads,), split over TP
        # sdpa: each ring block through SDPA's fused kernels where the device has one;
        # unfused (or the v1.x fp32-softmax flags in half precision): the explicit fp32 math
        fused = self.ops.attention_backend == "sdpa" and not self.fp32_softmax(ctx.dtype)
        state = ctx.state
        self.ring = RingAttention(state, "auto" if fused else "math") if state.cp_size > 1 else None

    def fp32_softmax(self, dtype: torch.dtype) -> bool:
        """SDPA's softmax precision is its kernel's choice: under fp16/bf16 the v1.x precision
        flags take the explicit matmul + fp32-softmax path instead."""
        wanted = self.ops.softmax_in_fp32 or self.qk_coeff is not None
        return wanted and dtype in (torch.float16, torch.bfloat16)

    def sink_logits(self, heads: int, device) -> torch.Tensor:
        """(heads,): the extra softmax logit of each head (sinks.py)."""
        if self.softmax_type == "learnable":
            return self.softmax_offset
        return torch.zeros(heads, device=device)  # off-by-one

    def forward(self, q, k, v, mask: AttentionMask = CAUSAL) -> torch.Tensor:
        if self.window is not None:  # a windowed layer: the mask narrowed to the window
            mask = windowed(mask, self.window)
        backend = choose_backend(self, mask, q)
        if k.size(1) < q.size(1) and not backend.grouped_kv:  # GQA: each key/value head
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # for its queries
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        v_dim = v.size(-1)
        if backend.equal_head_dims and v_dim < q.size(-1):  # zeros: no score or output changes
            v = F.pad(v, (0, q.size(-1) - v_dim))
        if self.recompute and self.training:
            # the tracker's streams are replayed only where the core draws from them (dropout)
            tracker = self.rng_tracker if self.dropout > 0 else None
            out = checkpoint(self._attend, tracker, backend, q, k, v, mask)
        else:
            out = self._attend(backend, q, k, v, mask)
        return out[..., :v_dim] if out.size(-1) > v_dim else out

    def _attend(self, backend, q, k, v, mask: AttentionMask):
        p = self.dropout if self.training else 0.0
        # Heads are split over TP, so their dropout masks come from the per-TP-rank stream.
        rng = self.rng_tracker.fork() if p > 0 and self.rng_tracker else contextlib.nullcontext()
        with rng:
            return backend.attend(self, q, k, v, mask, p)


class PrefixCache:
    """Two tensors per position seen so far, for one layer (generation): KVCache's keys and
    values, LatentKVCache's latents. Preallocated to `max_length` positions; `append` writes
    the new positions and returns all of them, so each new token costs attention over the
    prefix, not a recomputation of it."""

    def __init__(self, k_shape: tuple, v_shape: tuple, device, dtype):
        self.k = torch.empty(k_shape, device=device, dtype=dtype)  # (b, max_length, ...)
        self.v = torch.empty(v_shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        n = k.size(1)
        if self.length + n > self.k.size(1):
            raise ValueError(f"KV cache holds {self.k.size(1)} positions; {self.length + n} asked")
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n
        return self.k[:, : self.length], self.v[:, : self.length]

    def causal_mask(self, past: int, new: int) -> torch.Tensor:
        """(new, past + new) booleans: query i (at position past + i) sees keys <= past + i."""
        return causal_keep(new, past + new, self.k.device)[0, 0]

    def extend(self, k, v, mask: AttentionMask):
        """(every position's k and v, the mask of the new queries): append this step's s new
        positions after the cached prefix; one new position sees them all (causal), several
        see the prefix and themselves causally."""
        past, s = self.length, k.size(1)
        k, v = self.append(k, v)  # (b, past + s, ...)
        many = past and s > 1
        return k, v, AttentionMask.arbitrary(self.causal_mask(past, s)) if many else CAUSAL


class SelfAttention(nn.Module):
    """What every self-attention variant holds besides its projections: the core attention
    (`core`) and the row-parallel output projection `dense` (built last, after the variant's
    own weights, so the parameters keep their order)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: BuildContext,
        softmax_scale=None,
        qk_coeff=None,
        window: int | None = None,
    ):
        super().__init__()
        heads = cfg.num_attention_heads // ctx.state.tp_size
        self.core = CoreAttention(
            ctx,
            cfg.attention_dropout,
            softmax_scale,
            qk_coeff,
            window=window,
            softmax_type=cfg.softmax_type,
            heads=heads,
        )
        self.defer_bias = ctx.ops.bias_dropout_add == "compile" and cfg.add_bias_linear

    def _build_dense(self, cfg: ModelConfig, ctx: BuildContext, in_features: int) -> None:
        state = ctx.state
        self.dense = RowParallelLinear(
            in_features,
            cfg.hidden_size,
            group=state.tp_group,
            bias=cfg.add_bias_linear,
            init_method=None,
            sequence_parallel=state.sequence_parallel,
            input_is_parallel=True,
            device=ctx.device,
            dtype=ctx.dtype,
        )

    def _output(self, ctx: torch.Tensor) -> torch.Tensor:
        if self.defer_bias:  # --bias-dropout-fusion: the layer adds dense.bias in its fused op
            return self.dense.forward_without_bias(ctx)
        return self.dense(ctx)

    # the core's settings, read (and recompute set) on the attention as before the core existed
    @property
    def recompute_core(self) -> bool:
        return self.core.recompute

    @recompute_core.setter
    def recompute_core(self, on: bool) -> None:
        self.core.recompute = on

    @property
    def ring(self) -> RingAttention | None:
        return self.core.ring

    @property
    def softmax_scale(self) -> float | None:
        return self.core.softmax_scale

    @property
    def qk_coeff(self) -> float | None:
        return self.core.qk_coeff

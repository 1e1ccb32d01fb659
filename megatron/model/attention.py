"""Self-attention over this rank's heads (multi-head / grouped-query), and its KV cache.

Heads are split over the TP group: query_key_value is column-parallel, dense row-parallel, so
the block does one all-reduce forward and one backward (with sequence parallelism an
all-gather and a reduce-scatter of the sequence instead). Under context parallelism the core
attention is the ring of megatron.mpu.context_parallel. Multi-latent attention
(megatron.model.mla) derives from ParallelAttention and shares its core.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.masks import CAUSAL, AttentionMask, MaskType
from megatron.model.rope import RotaryEmbedding
from megatron.model.sdpa import sdpa_context
from megatron.mpu import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.mpu.context_parallel import RingAttention
from megatron.mpu.utils import divide


class KVCache:
    """Keys and values of the positions seen so far, for one layer (generation).

    Preallocated to `max_length` positions; `append` writes the new positions and returns all of
    them, so each new token costs attention over the prefix, not a recomputation of it.
    """

    def __init__(self, batch: int, max_length: int, groups: int, head_dim: int, device, dtype):
        shape = (batch, max_length, groups, head_dim)  # (b, s, g, d)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
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
        q = torch.arange(past, past + new, device=self.k.device).unsqueeze(1)
        return torch.arange(past + new, device=self.k.device).unsqueeze(0) <= q


class ParallelAttention(nn.Module):
    """Self-attention over this rank's heads: torch SDPA, or (--attention-backend)
    softmax(scale q k^T) v with a Triton (fused) or torch (unfused) scaled softmax.
    The `attention_mask` (model/masks.py) says which keys each query sees: CAUSAL (the default),
    or PADDING / ARBITRARY with a keep tensor (b, 1, s, s) (BERT's padding, the documents of a
    packed sample): SDPA's attn_mask, or a masked softmax. Under context parallelism the ring
    takes CAUSAL or RING_DOCUMENTS (a packed sample's document ids by chunk).

    query_key_value's output is laid out per query group as [q_1..q_{n/g}, k, v] (each of size
    head_dim), so a contiguous TP slice holds whole groups with their own keys and values.

    `layer_number` (1-based) is L of --apply-query-key-layer-scaling: scores q k^T / (sqrt(d) L)
    from the GEMM, softmax(L x scores) in fp32 (v1.x's fp16 overflow guard; equal in exact math).
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1):
        super().__init__()
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.rng_tracker = ctx.rng_tracker
        self.qk_coeff = float(layer_number) if cfg.apply_query_key_layer_scaling else None
        self.head_dim = cfg.head_dim
        self.heads = divide(cfg.num_attention_heads, state.tp_size)  # local query heads
        self.groups = divide(cfg.query_groups, state.tp_size)  # local key/value heads
        self.q_per_group = cfg.num_attention_heads // cfg.query_groups
        self.dropout = cfg.attention_dropout
        # --recompute-granularity selective (megatron.model.parallelize switches it on)
        self.recompute_core = False
        self.ops = ctx.ops
        self.softmax_scale = None  # None: 1 / sqrt(head size); MLA sets its own
        qkv_size = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        kw = {
            "group": state.tp_group,
            "bias": cfg.add_bias_linear,
            "init_method": None,
            "sequence_parallel": state.sequence_parallel,
            "device": device,
            "dtype": dtype,
        }
        self.query_key_value = ColumnParallelLinear(cfg.hidden_size, qkv_size, **kw)
        self.dense = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, input_is_parallel=True, **kw
        )
        self.defer_bias = self.ops.bias_dropout_add == "compile" and cfg.add_bias_linear
        # --context-parallel-size > 1: this rank's queries attend over keys/values ringed round
        # the CP group (mpu/context_parallel.py); the K/V go round as `groups` heads (GQA).
        # sdpa: each block through SDPA's fused kernels where the device has one; unfused (or
        # the v1.x fp32-softmax flags in half precision): the explicit fp32 math
        fused = self.ops.attention_backend == "sdpa" and not self._fp32_softmax(dtype)
        self.ring = RingAttention(state, "auto" if fused else "math") if state.cp_size > 1 else None
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(
                cfg.head_dim, cfg.max_positions, cfg.rotary_base, device, dtype
            )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        attention_mask: AttentionMask = CAUSAL,
    ) -> torch.Tensor:
        qkv = self.query_key_value(x)  # (b, s, ...): the full sequence, also when x is a slice
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.groups, self.q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(b, s, self.heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # (b, s, g, d)
        if self.rotary is not None:
            if position_ids is None:
                start = kv_cache.length if kv_cache is not None else 0
                position_ids = torch.arange(start, start + s, device=x.device).expand(b, s)
            q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        mask = attention_mask
        if kv_cache is not None:  # generation: attend to the cached prefix as well
            past = kv_cache.length
            k, v = kv_cache.append(k, v)  # (b, past + s, g, d)
            # s new queries after `past` cached keys (one new position sees them all: causal)
            many = past and s > 1
            mask = AttentionMask.arbitrary(kv_cache.causal_mask(past, s)) if many else CAUSAL
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        if self.q_per_group > 1 and self.ring is None:
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        ctx = self._attend(q, k, v, mask)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        if self.defer_bias:  # --bias-dropout-fusion: the layer adds dense.bias in its fused op
            return self.dense.forward_without_bias(ctx)
        return self.dense(ctx)

    def _attend(self, q, k, v, mask: AttentionMask):
        """The core attention, recomputed in backward under --recompute-granularity selective."""
        if self.recompute_core and self.training:
            # the tracker's streams are replayed only where the core draws from them (dropout)
            tracker = self.rng_tracker if self.dropout > 0 else None
            return checkpoint(self._core_attention, tracker, q, k, v, mask)
        return self._core_attention(q, k, v, mask)

    def _core_attention(self, q, k, v, mask: AttentionMask = CAUSAL):
        # q: (b, heads, s_q, d); k, v: (b, heads, s_k, d); s_q < s_k only for a KV cache's
        # queries, which are the last s_q positions.
        p = self.dropout if self.training else 0.0
        # Heads are split over TP, so their dropout masks come from the per-TP-rank stream.
        rng = self.rng_tracker.fork() if p > 0 and self.rng_tracker else contextlib.nullcontext()
        with rng:
            if self.ring is not None:  # context parallel (training: no cache)
                documents = _ring_documents(mask)
                return self.ring(q, k, v, p, documents, scale=self.softmax_scale)
            if mask.type is MaskType.RING_DOCUMENTS:
                raise ValueError("a ring-documents mask needs --context-parallel-size > 1")
            if self.ops.attention_backend != "sdpa" or self._fp32_softmax(q.dtype):
                scores, scale = self._scores(q, k)  # (b, heads, s_q, s_k)
                if mask.type is MaskType.CAUSAL:  # the queries at the end of the keys
                    probs = self.ops.causal_softmax(scores, scale)  # fp32 math inside
                else:  # padding, documents (or a KV-cache prefix)
                    probs = self.ops.masked_softmax(scores, mask.keep, scale)  # fp32 inside
                return torch.matmul(F.dropout(probs, p), v)
            with sdpa_context(self.ops.sdpa_backend):  # --sdpa-backend's kernel
                if mask.type is not MaskType.CAUSAL:
                    return F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask.keep, dropout_p=p, scale=self.softmax_scale
                    )
                # one query at the end of the keys sees them all; SDPA's is_causal aligns the
                # queries to the start: right only when s_q == s_k (KV caches with several new
                # queries pass an ARBITRARY mask)
                causal = q.size(2) > 1
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=p, is_causal=causal, scale=self.softmax_scale
                )

    def _fp32_softmax(self, dtype: torch.dtype) -> bool:
        """SDPA's softmax precision is its kernel's choice: under fp16/bf16 the v1.x precision
        flags take the explicit matmul + fp32-softmax path instead."""
        wanted = self.ops.softmax_in_fp32 or self.qk_coeff is not None
        return wanted and dtype in (torch.float16, torch.bfloat16)

    def _scores(self, q, k):
        """(q k^T, softmax scale); with --apply-query-key-layer-scaling (q k^T / (sqrt(d) L), L),
        the division done inside the GEMM so fp16 scores stay L times smaller."""
        if self.qk_coeff is None:
            scale = self.softmax_scale or 1.0 / math.sqrt(q.size(-1))
            return torch.matmul(q, k.transpose(-1, -2)), scale
        b, n, sq, d = q.shape
        q3, k3 = q.reshape(b * n, sq, d), k.reshape(b * n, -1, d)  # (b heads, s, d)
        out = torch.empty(b * n, sq, k3.size(1), dtype=q.dtype, device=q.device)
        alpha = 1.0 / (math.sqrt(d) * self.qk_coeff)
        out = torch.baddbmm(out, q3, k3.transpose(1, 2), beta=0.0, alpha=alpha)
        return out.view(b, n, sq, -1), self.qk_coeff


def _ring_documents(mask: AttentionMask):
    """What ring attention takes of `mask`: its documents, or None for CAUSAL."""
    if mask.type is MaskType.CAUSAL:
        return None
    if mask.type is MaskType.RING_DOCUMENTS:
        return mask.ring
    raise ValueError(
        f"ring attention (--context-parallel-size > 1) takes causal or document masks, not a "
        f"{mask.type.value} mask"
    )

"""One transformer layer: pre-norm attention and MLP with residuals (GPT-2), TP-split.

Activations are batch-first, (b, s, h). Attention heads and the MLP's inner dimension are split
over the TP group: query_key_value and dense_h_to_4h are column-parallel, dense and
dense_4h_to_h row-parallel, so each layer does one all-reduce forward and one backward per block.
With sequence parallelism (`state.sequence_parallel`) a layer's input and output are this TP
rank's (b, s/p, h): the column-parallel layers all-gather the sequence, the row-parallel ones
reduce-scatter it, and the norms, residuals and residual dropout run on the slice.
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
from megatron.model.mlp import ParallelMLP
from megatron.model.moe import MoELayer
from megatron.model.sdpa import sdpa_context
from megatron.mpu import (
    ColumnParallelLinear,
    ParallelState,
    RNGStatesTracker,
    RowParallelLinear,
    checkpoint,
)
from megatron.mpu.context_parallel import RingAttention
from megatron.mpu.utils import divide


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


def split_dropout_rng(state: ParallelState, rng_tracker: RNGStatesTracker | None):
    """The RNG context of dropout outside the TP regions: the default generator (the same on
    every TP rank, whose tensors are equal), or with sequence parallelism the TP-rank stream, so
    the s / p token slices of different ranks get independent masks."""
    if state.sequence_parallel and rng_tracker is not None:
        return rng_tracker.fork
    return contextlib.nullcontext


def _bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float
) -> torch.Tensor:
    """residual + dropout(x + bias): the ops --bias-dropout-fusion hands to torch.compile."""
    if bias is not None:
        x = x + bias
    return residual + (F.dropout(x, p) if p > 0.0 else x)


_FUSED = {}


def fused_bias_dropout_add():
    """_bias_dropout_add compiled once per process (on first use), as Megatron's jit_fuser
    (torch.jit.script in v1.x, torch.compile since torch 2.2) fuses it into one kernel.
    Inductor draws its dropout seed from the current generator, so the RNG tracker's forks and
    activation recompute replay the same masks."""
    if "fn" not in _FUSED:
        _FUSED["fn"] = torch.compile(_bias_dropout_add)
    return _FUSED["fn"]


def build_norm(cfg: ModelConfig, device=None, dtype=None) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon, device=device, dtype=dtype)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout (as Megatron-core and HF Llama): the pair (i, i + d/2)."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device=None, dtype=None):
        super().__init__()
        # Angles in float64; tables kept in float32 (or the model dtype when that is wider).
        table_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_positions, d)
        self.register_buffer("cos", angles.cos().to(device, table_dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(device, table_dtype), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # x: (b, s, n, d); position_ids: (b, s)
        cos = self.cos[position_ids].unsqueeze(2).to(x.dtype)  # (b, s, 1, d)
        sin = self.sin[position_ids].unsqueeze(2).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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
        if self.recompute_core and self.training:  # --recompute-granularity selective
            # the tracker's streams are replayed only where the core draws from them (dropout)
            tracker = self.rng_tracker if self.dropout > 0 else None
            ctx = checkpoint(self._core_attention, tracker, q, k, v, mask)
        else:
            ctx = self._core_attention(q, k, v, mask)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        if self.defer_bias:  # --bias-dropout-fusion: the layer adds dense.bias in its fused op
            return self.dense.forward_without_bias(ctx)
        return self.dense(ctx)

    def _core_attention(self, q, k, v, mask: AttentionMask = CAUSAL):
        # q: (b, heads, s_q, d); k, v: (b, heads, s_k, d); s_q < s_k only for a KV cache's
        # queries, which are the last s_q positions.
        p = self.dropout if self.training else 0.0
        # Heads are split over TP, so their dropout masks come from the per-TP-rank stream.
        rng = self.rng_tracker.fork() if p > 0 and self.rng_tracker else contextlib.nullcontext()
        with rng:
            if self.ring is not None:  # context parallel (training: no cache)
                return self.ring(q, k, v, dropout_p=p, documents=_ring_documents(mask))
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
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.keep, dropout_p=p)
                if q.size(2) == 1:  # one query at the end of the keys sees them all
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=p)
                # SDPA's is_causal aligns the queries to the start: right only when s_q == s_k
                # (KV caches with several new queries pass an ARBITRARY mask)
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def _fp32_softmax(self, dtype: torch.dtype) -> bool:
        """SDPA's softmax precision is its kernel's choice: under fp16/bf16 the v1.x precision
        flags take the explicit matmul + fp32-softmax path instead."""
        wanted = self.ops.softmax_in_fp32 or self.qk_coeff is not None
        return wanted and dtype in (torch.float16, torch.bfloat16)

    def _scores(self, q, k):
        """(q k^T, softmax scale); with --apply-query-key-layer-scaling (q k^T / (sqrt(d) L), L),
        the division done inside the GEMM so fp16 scores stay L times smaller."""
        if self.qk_coeff is None:
            return torch.matmul(q, k.transpose(-1, -2)), 1.0 / math.sqrt(q.size(-1))
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


class TransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))). Residual dropout uses the default
    generator, identical on every TP rank, because these tensors are replicated over TP; with
    sequence parallelism each TP rank holds other tokens, so it draws from the TP-rank stream.

    --apply-residual-connection-post-layernorm (v1.x, BERT's order): each residual starts from
    the normed input instead, n1 = norm(x); h = n1 + drop(attn(n1)); n2 = norm(h);
    out = n2 + drop(mlp(n2)).

    --bias-dropout-fusion: each block's output bias, dropout and residual add run as one
    torch.compile'd function (residual + dropout(out + bias)), as Megatron's fused
    bias_dropout_add; same values, other kernels (and on CUDA other dropout masks).
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1):
        super().__init__()
        self.hidden_dropout, self.ops = cfg.hidden_dropout, ctx.ops
        self.post_ln_residual = cfg.apply_residual_connection_post_layernorm
        self.bias_dropout_fusion = self.ops.bias_dropout_add == "compile"
        self.residual_rng = split_dropout_rng(ctx.state, ctx.rng_tracker)
        self.input_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        self.self_attention = ParallelAttention(cfg, ctx, layer_number)
        self.post_attention_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        # --num-experts: a router and experts instead of the MLP (every --moe-layer-freq-th)
        moe = cfg.is_moe_layer(layer_number - 1)
        self.mlp = MoELayer(cfg, ctx) if moe else ParallelMLP(cfg, ctx)
        # Draws from the RNG tracker's streams (activation recompute must replay them only
        # then): attention dropout, and residual dropout on sequence-parallel slices.
        forks = cfg.attention_dropout > 0 or (ctx.state.sequence_parallel and self.hidden_dropout)
        self.uses_rng_tracker = ctx.rng_tracker is not None and bool(forks)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        attention_mask: AttentionMask = CAUSAL,
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attn = self.self_attention(normed, position_ids, kv_cache, attention_mask)
        if self.post_ln_residual:
            x = normed
        if self.bias_dropout_fusion:
            attn_bias = self.self_attention.dense.bias
            if self._fuses_add_norm():  # the residual add goes into the norm's kernel
                zero = torch.zeros((), dtype=attn.dtype, device=attn.device)
                y, x = self._add_norm(self._fused(attn, attn_bias, zero), x)
            else:
                x = self._fused(attn, attn_bias, x)
                y = self.post_attention_layernorm(x)
            out = self.mlp(y)
            bias = None if isinstance(self.mlp, MoELayer) else self.mlp.dense_4h_to_h.bias
            return self._fused(out, bias, y if self.post_ln_residual else x)
        if self._fuses_add_norm():  # residual add + norm in one kernel (or Liger's)
            y, x = self._add_norm(self._dropout(attn), x)
            return (y if self.post_ln_residual else x) + self._dropout(self.mlp(y))
        x = x + self._dropout(attn)
        y = self.post_attention_layernorm(x)
        return (y if self.post_ln_residual else x) + self._dropout(self.mlp(y))

    def _fused(self, out, bias, residual):
        """residual + dropout(out + bias), one compiled function (--bias-dropout-fusion)."""
        p = self.hidden_dropout if self.training else 0.0
        with self.residual_rng() if p > 0.0 else contextlib.nullcontext():
            return fused_bias_dropout_add()(out, bias, residual, p)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return x
        with self.residual_rng():
            return F.dropout(x, p)

    def _fuses_add_norm(self) -> bool:
        rms = isinstance(self.post_attention_layernorm, RMSNorm)
        return self.ops.add_norm_impl(rms) != "torch"

    def _add_norm(self, x, residual):
        norm = self.post_attention_layernorm
        if isinstance(norm, RMSNorm):
            return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.ops.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)

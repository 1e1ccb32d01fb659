"""Multi-latent attention (DeepSeek-V2/V3; Megatron-core's MLASelfAttention), heads split over TP.

Per token x (h):
    queries   q = q_b_proj(norm(q_a_proj(x)))   (or q_proj(x) without --q-lora-rank)
              -> per head [q_nope (qk-head-dim), q_pe (qk-pos-emb-head-dim)], RoPE on q_pe
    latent    [c, k_pe] = kv_a_proj_with_mqa(x);  c = norm(c) (kv-lora-rank);  RoPE on k_pe,
              one k_pe per token shared by every head
    keys      per head [k_nope, k_pe], values v: [k_nope, v] = kv_b_proj(c) per head
    output    dense(softmax(q k^T scale) v), scale = m^2 / sqrt(qk-head-dim + pos dim), m the
              YaRN softmax factor (0.1 mscale-all-dim ln s + 1; 1 without YaRN)

Parallel layout: the down projections (q_a_proj, kv_a_proj_with_mqa) and the latent norms are
replicated over TP (plain weights); the up projections (q_proj / q_b_proj, kv_b_proj) are
column-parallel by heads, dense row-parallel. The replicated part runs on this rank's tokens:
with sequence parallelism on its s / p slice (its parameters are marked sequence_parallel, their
gradients summed over TP; k_pe is all-gathered, the gradient reduce-scattered), else on the
whole sequence, where k_pe enters the TP region through copy_to (backward: all-reduce).

Generation caches the normed latent c and the rotated k_pe (LatentKVCache:
kv-lora-rank + qk-pos-emb-head-dim numbers per token and layer, replicated over TP) and
expands them through kv_b_proj at each step. The core attention (SDPA, the ring under context
parallelism with the values' head size padded, the unfused path, selective recompute) is
ParallelAttention's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.attention import KVCache, ParallelAttention
from megatron.model.context import BuildContext
from megatron.model.masks import CAUSAL, AttentionMask
from megatron.model.norms import build_norm
from megatron.model.rope import RotaryEmbedding, yarn_get_mscale, yarn_inv_freq
from megatron.mpu import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
)
from megatron.mpu.context_parallel import RingAttention
from megatron.mpu.utils import divide


class LatentKVCache(KVCache):
    """One layer's compressed cache: the normed latent c (b, s, kv-lora-rank) as `k` and the
    rotated k_pe (b, s, qk-pos-emb-head-dim) as `v` (KVCache's append and masks)."""

    def __init__(self, batch: int, max_length: int, rank: int, pos_dim: int, device, dtype):
        self.k = torch.empty(batch, max_length, rank, device=device, dtype=dtype)
        self.v = torch.empty(batch, max_length, pos_dim, device=device, dtype=dtype)
        self.length = 0

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
        """Bytes one token takes in one layer's cache."""
        return (cfg.kv_rank + cfg.qk_rope_dim) * element_size


def mla_rotary(cfg: ModelConfig, device=None, dtype=None) -> RotaryEmbedding:
    """The RoPE of the decoupled part: plain (--rope-type rope) or YaRN's."""
    dim, base = cfg.qk_rope_dim, cfg.rotary_base
    if cfg.mla_rope_type == "rope":
        return RotaryEmbedding(dim, cfg.max_positions, base, device, dtype)
    s = cfg.rotary_scaling_factor
    inv_freq = yarn_inv_freq(
        dim, base, s, cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow
    )
    factor = yarn_get_mscale(s, cfg.mscale) / yarn_get_mscale(s, cfg.mscale_all_dim)
    return RotaryEmbedding(dim, cfg.max_positions, base, device, dtype, inv_freq, factor)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """m^2 / sqrt(query head size), m = YaRN's mscale-all-dim factor (Megatron-core's, HF's)."""
    m = yarn_get_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    return m * m / math.sqrt(cfg.qk_nope_dim + cfg.qk_rope_dim)


class MultiLatentAttention(ParallelAttention):
    """Multi-latent self-attention over this rank's heads (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1):
        nn.Module.__init__(self)
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.rng_tracker, self.ops, self.qk_coeff = ctx.rng_tracker, ctx.ops, None
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.heads = self.groups = divide(cfg.num_attention_heads, state.tp_size)
        self.q_per_group, self.dropout, self.recompute_core = 1, cfg.attention_dropout, False
        self.nope, self.pos, self.v_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_dim
        self.head_dim = self.nope + self.pos  # of queries and keys
        self.kv_rank, self.q_rank = cfg.kv_rank, cfg.q_lora_rank
        self.softmax_scale = mla_softmax_scale(cfg)
        n, h = cfg.num_attention_heads, cfg.hidden_size
        kw = {
            "group": state.tp_group,
            "bias": False,
            "init_method": None,
            "sequence_parallel": state.sequence_parallel,
            "device": device,
            "dtype": dtype,
        }
        if self.q_rank is None:
            self.q_proj = ColumnParallelLinear(h, n * self.head_dim, **kw)
        else:
            self.q_a_proj = self._replicated(h, self.q_rank, device, dtype)
            self.q_a_layernorm = build_norm(cfg, device, dtype, self.q_rank)
            self.q_b_proj = ColumnParallelLinear(self.q_rank, n * self.head_dim, **kw)
        self.kv_a_proj_with_mqa = self._replicated(h, self.kv_rank + self.pos, device, dtype)
        self.kv_a_layernorm = build_norm(cfg, device, dtype, self.kv_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, n * (self.nope + self.v_dim), **kw)
        kw["bias"] = cfg.add_bias_linear
        self.dense = RowParallelLinear(n * self.v_dim, h, input_is_parallel=True, **kw)
        self.defer_bias = self.ops.bias_dropout_add == "compile" and cfg.add_bias_linear
        fused = self.ops.attention_backend == "sdpa" and not self._fp32_softmax(dtype)
        self.ring = RingAttention(state, "auto" if fused else "math") if state.cp_size > 1 else None
        self.rotary = mla_rotary(cfg, device, dtype)

    def _replicated(self, inp: int, out: int, device, dtype) -> nn.Linear:
        """A down projection: the same weight on every TP rank; under sequence parallelism
        it sees this rank's tokens only, so its gradient is summed over TP."""
        linear = nn.Linear(inp, out, bias=False, device=device, dtype=dtype)
        if self.sequence_parallel:
            mark_sequence_parallel(linear.weight)
        return linear

    def new_cache(self, batch: int, max_length: int, device, dtype) -> LatentKVCache:
        return LatentKVCache(batch, max_length, self.kv_rank, self.pos, device, dtype)

    def _attend(self, q, k, v, mask: AttentionMask):
        """The core attention with the values zero-padded to the query/key head size where
        they are narrower (no score and no output changes): PyTorch's flash kernels (CPU and
        CUDA) take equal head sizes only, and would otherwise fall back to the score matrix
        (as Transformer Engine pads MLA for flash attention). The ring pads for itself."""
        fused = self.ops.attention_backend == "sdpa" and not self._fp32_softmax(q.dtype)
        if self.ring is not None or v.size(-1) >= q.size(-1) or not fused:
            return super()._attend(q, k, v, mask)
        v = F.pad(v, (0, q.size(-1) - v.size(-1)))
        return super()._attend(q, k, v, mask)[..., : self.v_dim]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, heads, nope + pos) of the whole sequence (x may be a sequence slice)."""
        if self.q_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*q.shape[:2], self.heads, self.head_dim)

    def _latent(self, x: torch.Tensor):
        """(normed latent c (b, s', kv-lora-rank) on x's tokens, k_pe (b, s, pos) of the whole
        sequence, entering the TP region)."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.pos], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.sequence_parallel:  # (b, s/p, pos) -> (b, s, pos); backward reduce-scatters
            return latent, gather_from_sequence_parallel_region(k_pe, self.tp_group)
        return latent, copy_to_tensor_model_parallel_region(k_pe, self.tp_group)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: LatentKVCache | None = None,
        attention_mask: AttentionMask = CAUSAL,
    ) -> torch.Tensor:
        q = self._queries(x)  # (b, s, n, nope + pos)
        b, s = q.shape[:2]
        latent, k_pe = self._latent(x)
        if position_ids is None:
            start = kv_cache.length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + s, device=x.device).expand(b, s)
        q_nope, q_pe = q.split([self.nope, self.pos], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_pe, position_ids)], dim=-1)
        k_pe = self.rotary(k_pe.unsqueeze(2), position_ids).squeeze(2)  # (b, s, pos)
        mask = attention_mask
        if kv_cache is not None:  # generation: the cached latents of the prefix as well
            if self.sequence_parallel:
                raise ValueError("a KV cache needs the whole sequence: no --sequence-parallel")
            past = kv_cache.length
            latent, k_pe = kv_cache.append(latent, k_pe)  # (b, past + s, ...)
            many = past and s > 1
            mask = AttentionMask.arbitrary(kv_cache.causal_mask(past, s)) if many else CAUSAL
        kv = self.kv_b_proj(latent)  # (b, S, n (nope + v)), S: every key position
        kv = kv.view(b, kv.size(1), self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.heads, -1)  # one per token, every head
        k = torch.cat([k_nope, k_pe], dim=-1)  # (b, S, n, nope + pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s, d)
        ctx = self._attend(q, k, v, mask)  # (b, n, s, v)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.heads * self.v_dim)
        if self.defer_bias:  # --bias-dropout-fusion: the layer adds dense.bias in its fused op
            return self.dense.forward_without_bias(ctx)
        return self.dense(ctx)

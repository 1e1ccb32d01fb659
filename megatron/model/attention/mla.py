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
expands them through kv_b_proj at each step. The core attention (SDPA with the values' head
size padded to the queries', the ring under context parallelism, the unfused path, selective
recompute) is core.CoreAttention, which MLA builds and owns as standard attention does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.attention.core import PrefixCache, SelfAttention
from megatron.model.attention.masks import CAUSAL, AttentionMask
from megatron.model.context import BuildContext
from megatron.model.norms import build_norm
from megatron.model.rope import RotaryEmbedding, yarn_get_mscale, yarn_inv_freq
from megatron.mpu import (
    ColumnParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
)
from megatron.mpu.utils import divide


class LatentKVCache(PrefixCache):
    """One layer's compressed cache: the normed latent c (b, s, kv-lora-rank) as `k` and the
    rotated k_pe (b, s, qk-pos-emb-head-dim) as `v`."""

    def __init__(self, batch: int, max_length: int, rank: int, pos_dim: int, device, dtype):
        super().__init__((batch, max_length, rank), (batch, max_length, pos_dim), device, dtype)

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


class MultiLatentAttention(SelfAttention):
    """Multi-latent self-attention over this rank's heads (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1, window=None):
        super().__init__(cfg, ctx, softmax_scale=mla_softmax_scale(cfg), window=window)
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.tp_group, self.sequence_parallel = state.tp_group, state.sequence_parallel
        self.heads = divide(cfg.num_attention_heads, state.tp_size)
        self.nope, self.pos, self.v_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_dim
        self.head_dim = self.nope + self.pos  # of queries and keys
        self.kv_rank, self.q_rank = cfg.kv_rank, cfg.q_lora_rank
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
        self._build_dense(cfg, ctx, n * self.v_dim)
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
            latent, k_pe, mask = kv_cache.extend(latent, k_pe, mask)  # (b, past + s, ...)
        kv = self.kv_b_proj(latent)  # (b, S, n (nope + v)), S: every key position
        kv = kv.view(b, kv.size(1), self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.heads, -1)  # one per token, every head
        k = torch.cat([k_nope, k_pe], dim=-1)  # (b, S, n, nope + pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s, d)
        ctx = self.core(q, k, v, mask)  # (b, n, s, v)
        return self._output(ctx.transpose(1, 2).reshape(b, s, self.heads * self.v_dim))

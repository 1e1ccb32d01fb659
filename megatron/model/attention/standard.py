"""Multi-head / grouped-query self-attention over this rank's heads, and its KV cache.

Heads are split over the TP group: query_key_value is column-parallel, dense row-parallel, so
the block does one all-reduce forward and one backward (with sequence parallelism an
all-gather and a reduce-scatter of the sequence instead). The core attention (the mask, the
kernel, dropout, recompute, the ring under context parallelism) is core.CoreAttention, which
multi-latent attention (mla.py) builds too.
"""

from __future__ import annotations

import torch

from megatron.config.schema import ModelConfig
from megatron.model.attention.core import PrefixCache, SelfAttention
from megatron.model.attention.masks import CAUSAL, AttentionMask
from megatron.model.context import BuildContext
from megatron.model.rope import RotaryEmbedding
from megatron.mpu import ColumnParallelLinear
from megatron.mpu.utils import divide


class KVCache(PrefixCache):
    """Keys and values of the positions seen so far, for one layer: (b, max_length, groups, d)
    each."""

    def __init__(self, batch: int, max_length: int, groups: int, head_dim: int, device, dtype):
        shape = (batch, max_length, groups, head_dim)  # (b, s, g, d)
        super().__init__(shape, shape, device, dtype)


class ParallelAttention(SelfAttention):
    """Self-attention over this rank's heads: torch SDPA, or (--attention-backend)
    softmax(scale q k^T) v with a Triton (fused) or torch (unfused) scaled softmax.
    The `attention_mask` (masks.py) says which keys each query sees: CAUSAL (the default),
    PADDING / ARBITRARY with a keep tensor (b, 1, s, s) (BERT's padding, a KV-cache prefix):
    SDPA's attn_mask, or a masked softmax; or VARLEN, the documents of a packed sample by
    cu_seqlens (varlen.py). Under context parallelism the ring
    takes CAUSAL or RING_DOCUMENTS (a packed sample's document ids by chunk).

    query_key_value's output is laid out per query group as [q_1..q_{n/g}, k, v] (each of size
    head_dim), so a contiguous TP slice holds whole groups with their own keys and values.

    `layer_number` (1-based) is L of --apply-query-key-layer-scaling (core.CoreAttention);
    `window`: LEFT of a windowed layer (--window-size), None for a global one.
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1, window=None):
        qk_coeff = float(layer_number) if cfg.apply_query_key_layer_scaling else None
        super().__init__(cfg, ctx, qk_coeff=qk_coeff, window=window)
        state, device, dtype = ctx.state, ctx.device, ctx.dtype
        self.head_dim = cfg.head_dim
        self.heads = divide(cfg.num_attention_heads, state.tp_size)  # local query heads
        self.groups = divide(cfg.query_groups, state.tp_size)  # local key/value heads
        self.q_per_group = cfg.num_attention_heads // cfg.query_groups
        qkv_size = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        self.query_key_value = ColumnParallelLinear(
            cfg.hidden_size,
            qkv_size,
            group=state.tp_group,
            bias=cfg.add_bias_linear,
            init_method=None,
            sequence_parallel=state.sequence_parallel,
            device=device,
            dtype=dtype,
        )
        self._build_dense(cfg, ctx, cfg.num_attention_heads * cfg.head_dim)
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
            k, v, mask = kv_cache.extend(k, v, mask)  # (b, past + s, g, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads or groups, s, d)
        ctx = self.core(q, k, v, mask)  # (b, heads, s, d)
        return self._output(ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

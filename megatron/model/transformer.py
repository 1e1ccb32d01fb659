"""One transformer layer: pre-norm attention and MLP with residuals (GPT-2), TP-split.

Activations are batch-first, (b, s, h). Attention heads (megatron.model.attention: standard or
mla) and the MLP's inner dimension are split over the TP group: query_key_value and
dense_h_to_4h are column-parallel, dense and dense_4h_to_h row-parallel, so each layer does
one all-reduce forward and one backward per block.
With sequence parallelism (`state.sequence_parallel`) a layer's input and output are this TP
rank's (b, s/p, h): the column-parallel layers all-gather the sequence, the row-parallel ones
reduce-scatter it, and the norms, residuals and residual dropout run on the slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.attention.masks import CAUSAL, AttentionMask
from megatron.model.attention.mla import MultiLatentAttention
from megatron.model.attention.standard import KVCache, ParallelAttention
from megatron.model.context import BuildContext
from megatron.model.mlp import ParallelMLP
from megatron.model.norms import RMSNorm, build_norm
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.random import RNGStatesTracker


def build_attention(cfg: ModelConfig, ctx: BuildContext, layer_number: int = 1, window=None):
    """The self-attention of a layer: multi-latent (--multi-latent-attention) or multi-head /
    grouped-query attention; `window` LEFT of a windowed layer (None: global)."""
    if cfg.multi_latent_attention:
        return MultiLatentAttention(cfg, ctx, layer_number, window)
    return ParallelAttention(cfg, ctx, layer_number, window)


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


class TransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))), `mlp` built by `feed_forward`
    (megatron.model.layer_kinds: the dense MLP, or MoE). Residual dropout uses the default
    generator, identical on every TP rank, because these tensors are replicated over TP; with
    sequence parallelism each TP rank holds other tokens, so it draws from the TP-rank stream.

    --apply-residual-connection-post-layernorm (v1.x, BERT's order): each residual starts from
    the normed input instead, n1 = norm(x); h = n1 + drop(attn(n1)); n2 = norm(h);
    out = n2 + drop(mlp(n2)).

    --bias-dropout-fusion: each block's output bias, dropout and residual add run as one
    torch.compile'd function (residual + dropout(out + bias)), as Megatron's fused
    bias_dropout_add; same values, other kernels (and on CUDA other dropout masks).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        feed_forward: Callable[[ModelConfig, BuildContext], nn.Module] = ParallelMLP,
        window: int | None = None,
    ):
        super().__init__()
        self.hidden_dropout, self.ops = cfg.hidden_dropout, ctx.ops
        self.post_ln_residual = cfg.apply_residual_connection_post_layernorm
        self.bias_dropout_fusion = self.ops.bias_dropout_add == "compile"
        self.residual_rng = split_dropout_rng(ctx.state, ctx.rng_tracker)
        self.input_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        self.self_attention = build_attention(cfg, ctx, layer_number, window)
        self.post_attention_layernorm = build_norm(cfg, ctx.device, ctx.dtype)
        # the dense MLP, or a router and experts (its kind: megatron.model.layer_kinds)
        self.mlp = feed_forward(cfg, ctx)
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
            bias = getattr(self.mlp, "deferred_bias", None)  # what its forward left out
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

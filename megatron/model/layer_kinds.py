"""The layer kinds a transformer stack is built from, by name: one registry.

The kind of each layer is computed once from the config (megatron.config.layer_pattern's
`layer_kinds`: today attention + dense MLP, or attention + MoE where --moe-layer-freq says, as
DeepSeek's dense first layers); every stack (the GPT and its pipeline stages, DeepSpeed's
pipeline layers, BERT, the multi-token prediction depths) builds layer i by asking this registry
for its kind, never by branching on it. A new kind is one module (its layer class and a
`LayerKind`) plus its entry in `_KINDS`; a test may add one with `register_layer_kind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from megatron.config.layer_pattern import (
    ATTENTION_MLP,
    ATTENTION_MOE,
    WINDOW_ATTENTION_MLP,
    WINDOW_ATTENTION_MOE,
)
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.mlp import ParallelMLP
from megatron.model.moe import MoELayer
from megatron.model.transformer import TransformerLayer


class LayerKind(Protocol):
    def build(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int) -> nn.Module:
        """Layer `layer_number` (1-based) of the stack; forward(x, position_ids, kv_cache,
        attention_mask) -> x, shapes (b, s, h), or (b, s/p, h) under sequence parallelism."""
        ...


@dataclass(frozen=True)
class AttentionKind:
    """A TransformerLayer: pre-norm self-attention, then `feed_forward(cfg, ctx)` (its module
    is the layer's `mlp`, so the checkpoint names are `layers.<i>.mlp.*` for every kind).
    `windowed`: its attention sees the LEFT keys of --window-size before each query."""

    feed_forward: Callable[[ModelConfig, BuildContext], nn.Module]
    windowed: bool = False

    def window(self, cfg: ModelConfig) -> int | None:
        """LEFT of this kind's window under `cfg`, or None (global attention)."""
        return cfg.window[0] if self.windowed and cfg.window is not None else None

    def build(self, cfg: ModelConfig, ctx: BuildContext, layer_number: int) -> nn.Module:
        return TransformerLayer(cfg, ctx, layer_number, self.feed_forward, self.window(cfg))


_KINDS: dict[str, LayerKind] = {
    ATTENTION_MLP: AttentionKind(ParallelMLP),
    ATTENTION_MOE: AttentionKind(MoELayer),  # --num-experts: a router and experts
    WINDOW_ATTENTION_MLP: AttentionKind(ParallelMLP, windowed=True),  # --window-size
    WINDOW_ATTENTION_MOE: AttentionKind(MoELayer, windowed=True),
}


def register_layer_kind(name: str, kind: LayerKind) -> None:
    """Add a kind under a new name (one registration; a name is never redefined)."""
    if name in _KINDS and _KINDS[name] is not kind:
        raise ValueError(f"layer kind {name!r} is already registered as {_KINDS[name]!r}")
    _KINDS[name] = kind


def layer_kind(name: str) -> LayerKind:
    if name not in _KINDS:
        raise ValueError(f"no layer kind {name!r}; registered: {', '.join(sorted(_KINDS))}")
    return _KINDS[name]


def build_layer(kinds: tuple[str, ...], cfg: ModelConfig, ctx: BuildContext, index: int):
    """Layer `index` (0-based) of a stack whose layers have `kinds`, as its kind builds it."""
    return layer_kind(kinds[index]).build(cfg, ctx, index + 1)


def check_layer_kinds(kinds: tuple[str, ...], cfg: ModelConfig) -> tuple[str, ...]:
    """`kinds` if it names a registered kind for each of --num-layers layers."""
    if len(kinds) != cfg.num_layers:
        raise ValueError(f"{len(kinds)} layer kinds for --num-layers {cfg.num_layers}")
    for name in kinds:
        layer_kind(name)
    return tuple(kinds)


def attention_kind(name: str) -> AttentionKind:
    """The attention kind `name` (DeepSpeed's pipeline layers subclass TransformerLayer, so
    they build attention kinds only: its feed-forward block and window)."""
    kind = layer_kind(name)
    if not isinstance(kind, AttentionKind):
        raise ValueError(
            f"layer kind {name!r} is not attention + a feed-forward block: DeepSpeed's "
            "pipeline (--deepspeed with pipeline parallelism) builds those only; use the "
            "native pipeline"
        )
    return kind


def attention_feed_forward(name: str) -> Callable[[ModelConfig, BuildContext], nn.Module]:
    """The feed-forward block of the attention kind `name` (attention_kind)."""
    return attention_kind(name).feed_forward

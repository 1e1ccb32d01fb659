"""Running a chunk's transformer layers with full activation recompute (--recompute-granularity
full). Selective recompute lives inside the attention layer's core (`attention/core.py`,
CoreAttention.recompute); megatron.model.parallelize switches either on after the model is
built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron.mpu.random import checkpoint


@dataclass(frozen=True)
class LayerRecompute:
    """uniform: checkpoint every group of `num_layers` consecutive layers; block: checkpoint the
    first `num_layers` layers only. `impl`: another checkpoint implementation (DeepSpeed's, or
    --distribute-checkpointed-activations'); None: torch's."""

    method: str
    num_layers: int
    impl: Callable | None = None


def run_layers(layers, x, position_ids, mask, recompute: LayerRecompute | None, tracker, training):
    """x through `layers` in order, recomputing activations in backward as `recompute` says
    (only while training). The mask goes last: DeepSpeed's activation partitioning leaves
    non-tensor arguments whole."""
    extra = (position_ids, None, mask)  # (position ids, no KV cache, attention mask)
    if recompute is None or not training:
        for layer in layers:
            x = layer(x, *extra)
        return x
    n, impl = recompute.num_layers, recompute.impl
    if not any(getattr(layer, "uses_rng_tracker", True) for layer in layers):
        tracker = None  # nothing to replay: a plain checkpoint, which torch.compile can trace
    if recompute.method == "block":
        for i, layer in enumerate(layers):
            x = checkpoint(layer, tracker, x, *extra, impl=impl) if i < n else layer(x, *extra)
        return x
    for start in range(0, len(layers), n):
        group = layers[start : start + n]
        x = checkpoint(_Sequential(group), tracker, x, *extra, impl=impl)
    return x


class _Sequential:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x, *extra):
        for layer in self.layers:
            x = layer(x, *extra)
        return x

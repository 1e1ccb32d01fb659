"""The local / global attention settings of the model (Megatron-core's flag names): sliding
windows (--window-size, --window-attn-skip-freq) and attention sinks (--softmax-type).

They are fields of `ModelConfig` (declared here for size; `ModelConfig` derives from
`WindowSettings`), so checkpoints record them: a window changes what a loaded model computes,
a learnable sink adds one parameter per head. Which layers are windowed is read through the
per-layer pattern (megatron.config.layer_pattern: a windowed layer is attention with a
window); the rules between settings are megatron.config.rules_window.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import ConfigError, Section, setting
from megatron.config.layer_pattern import window_layer_pattern

WINDOW_FLAG = "--window-size"
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def parse_window(value: str) -> tuple[int, int]:
    """--window-size 'LEFT,RIGHT' (or '(LEFT, RIGHT)', or 'LEFT': RIGHT 0) as two ints."""
    text = "".join(str(value).split()).strip("()[]")
    parts = text.split(",")
    if not 1 <= len(parts) <= 2 or not all(p.lstrip("-").isdigit() for p in parts):
        raise ConfigError(
            f"{WINDOW_FLAG}: {value!r} is not LEFT,RIGHT. Fix: pass two integers, the tokens "
            "each query sees back and ahead, e.g. --window-size 4096,0 (causal: RIGHT is 0)"
        )
    left, right = (int(p) for p in parts) if len(parts) == 2 else (int(parts[0]), 0)
    return left, right


@dataclass(frozen=True)
class WindowSettings(Section):
    """Sliding-window (local) attention and attention sinks (docs/attention.md)."""

    window_size: str | None = setting(
        None,
        "sliding-window attention: LEFT,RIGHT, each query sees the LEFT tokens before it and "
        "itself (RIGHT: tokens ahead, 0 for the causal GPT), on the layers "
        "--window-attn-skip-freq leaves windowed (default: none, every layer global)",
        metavar="LEFT,RIGHT",
    )
    window_attn_skip_freq: str | None = setting(
        None,
        "with --window-size, which layers stay global: an integer N (every N-th layer, "
        "1-based: Gemma 3 is 6, gpt-oss 2) or a list of 1 (windowed) / 0 (global) per layer "
        "such as '([1]*5+[0]*1)*4' (default: every layer windowed, as Mistral)",
        metavar="N|PATTERN",
    )
    softmax_type: str = setting(
        "vanilla",
        "attention softmax: vanilla; off-by-one, one extra zero logit in every row (a "
        "sink: a query may attend to nothing); learnable, one learned sink logit per head "
        "(gpt-oss)",
        choices=SOFTMAX_TYPES,
    )

    @property
    def window(self) -> tuple[int, int] | None:
        """(LEFT, RIGHT) of --window-size, or None (no window)."""
        return None if self.window_size is None else parse_window(self.window_size)

    @property
    def window_layers(self) -> tuple[int, ...]:
        """1 for each windowed layer, 0 for each global one (a list of another length than
        --num-layers keeps its own, refused by megatron.config.rules_window)."""
        skip = self.window_attn_skip_freq
        return window_layer_pattern(self.window_size is not None, skip, self.num_layers)

    def keys_per_query(self, seq: int) -> tuple[int, ...]:
        """The keys each query of each layer is counted to score in the FLOPs (Megatron's
        convention counts every query against all `seq` keys): seq for a global layer, the
        window's LEFT + 1 (at most seq) for a windowed one."""
        if self.window is None:
            return (seq,) * self.num_layers
        span = min(seq, self.window[0] + 1)
        return tuple(span if w else seq for w in self.window_layers)

"""Rules of sliding-window attention and attention sinks (--window-size,
--window-attn-skip-freq, --softmax-type); each setting's own limits are declared on it
(megatron.config.schema_model_window). Nothing runs without the window it was given: what
cannot keep it (the ring of context parallelism today) is refused before any work."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.layer_pattern import WINDOW_FLAG as SKIP_FLAG
from megatron.config.schema import MegatronConfig, ModelConfig
from megatron.config.schema_model_window import WINDOW_FLAG


def validate_window_model(m: ModelConfig) -> None:
    """The window and its layers against the model's shape."""
    if m.window_size is None:
        if m.window_attn_skip_freq is not None:
            fail(
                SKIP_FLAG,
                "says which layers are windowed, but there is no window",
                f"add {WINDOW_FLAG} LEFT,0, or drop {SKIP_FLAG}",
            )
        return
    left, right = m.window  # ConfigError naming the flag where it does not parse
    if left < 0:
        fail(
            WINDOW_FLAG,
            f"LEFT {left} is negative (Megatron-core's -1: no limit, global)",
            f"drop {WINDOW_FLAG} for global attention, or give the tokens each query sees back",
        )
    if right != 0:
        fail(
            WINDOW_FLAG,
            f"RIGHT {right} lets a query see tokens ahead; the GPT is causal",
            f"pass {WINDOW_FLAG} {left},0",
        )
    if left + 1 >= m.seq_length:
        fail(
            WINDOW_FLAG,
            f"a window of {left} tokens back covers all of --seq-length {m.seq_length}: the "
            "layers would be global",
            f"drop {WINDOW_FLAG} (global attention), or use a LEFT below {m.seq_length - 1}",
        )
    pattern = m.window_layers
    if len(pattern) != m.num_layers:
        fail(
            SKIP_FLAG,
            f"the pattern has {len(pattern)} entries but --num-layers is {m.num_layers}",
            "give one 1 (windowed) or 0 (global) per layer",
        )
    if not any(pattern):
        fail(
            SKIP_FLAG,
            f"{m.window_attn_skip_freq} leaves no layer windowed",
            f"use a frequency of 2 or more, a pattern with a 1, or drop {WINDOW_FLAG}",
        )
    for i in range(m.num_layers):
        owner = m.layer_owner(i)
        if pattern[i] != pattern[owner]:
            fail(
                SKIP_FLAG,
                f"layer {i} runs the weights of layer {owner} (--num-unique-layers) but one is "
                "windowed and the other global",
                "give layers that share weights the same entry",
            )


def validate_window_parallel(cfg: MegatronConfig) -> None:
    """Context parallelism's ring takes causal and document masks only: a window or a sink
    under it is refused rather than silently dropped."""
    m, cp = cfg.model, cfg.parallel.context_parallel_size
    if cp == 1:
        return
    if m.window_size is not None:
        fail(
            WINDOW_FLAG,
            f"ring attention (--context-parallel-size {cp}) does not apply the window yet: it "
            "would run the windowed layers as global ones",
            f"drop --context-parallel-size (1), or drop {WINDOW_FLAG}",
        )
    if m.softmax_type != "vanilla":
        fail(
            f"--softmax-type {m.softmax_type}",
            f"ring attention (--context-parallel-size {cp}) merges its blocks without the sink "
            "logit",
            "drop --context-parallel-size (1), or use --softmax-type vanilla",
        )


def refuse_window_for_bert(m: ModelConfig) -> None:
    """BERT attends both ways: a causal window (LEFT back, nothing ahead of its own) would let
    its queries see every key ahead; windows are the GPT's."""
    if m.window_size is not None:
        fail(
            WINDOW_FLAG,
            "BERT attends in both directions; the window is the causal GPT's (LEFT keys back)",
            f"drop {WINDOW_FLAG} for BERT",
        )

"""The tiny GPT the model-level tests build: 2 layers, 64 wide, 8 heads, 16 tokens, a vocab of
100 padded to a multiple of 8, no dropout; `tiny_gpt(**overrides)` changes any field."""

from __future__ import annotations

from megatron.config.schema import ModelConfig

TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    seq_length=16,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def tiny_gpt(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})

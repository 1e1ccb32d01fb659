"""The transformer building blocks the model families share (megatron/models/<family>/)."""

from megatron.model.transformer import ParallelAttention, ParallelMLP, RMSNorm, TransformerLayer

__all__ = ["ParallelAttention", "ParallelMLP", "RMSNorm", "TransformerLayer"]

from megatron.model.gpt import GPTModel, init_weights
from megatron.model.transformer import ParallelAttention, ParallelMLP, RMSNorm, TransformerLayer

__all__ = [
    "GPTModel",
    "ParallelAttention",
    "ParallelMLP",
    "RMSNorm",
    "TransformerLayer",
    "init_weights",
]

"""The tiny models the tests build, so no test retypes one.

`tiny_gpt`: 2 layers, 64 wide, 8 heads, 16 tokens, a vocab of 100 padded to a multiple of 8, no
dropout. `small_gpt`: the multi-rank tests' GPT, 2 layers, 32 wide, 4 heads, 8 tokens, 64 vocab
rows at TP 1 and 2. `tiny_mla`, `tiny_moe` and `tiny_deepseek` add multi-latent attention, experts,
or both with DeepSeek-V3's router and MTP. Every function takes any field as an override.
"""

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
SMALL = dict(
    TINY,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=8,
    vocab_size=64,
    make_vocab_size_divisible_by=32,  # 64 rows at TP 1 and 2
)
# Llama's (and DeepSeek's) layer: RoPE, RMSNorm, SwiGLU, no biases
LLAMA = dict(
    position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False
)


def mla_fields(q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim) -> dict:
    """Multi-latent attention's shape: the query and key/value latents, the query/key head's
    non-rotary and rotary dims, the value head's dim."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_head_dim=qk_head_dim,
        qk_pos_emb_head_dim=qk_pos_emb_head_dim,
        v_head_dim=v_head_dim,
    )


# Multi-latent attention with a query latent, value heads narrower than query / key heads, YaRN
MLA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    **mla_fields(16, 8, 4, 4, 6),
    rotary_scaling_factor=2.0,
    original_max_position_embeddings=4,
    mscale_all_dim=1.0,
)
# DeepSeek-V3's router: sigmoid scores, a balancing bias on each expert, weights scaled by 2.5
V3_ROUTER = dict(
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
)
# DeepSeek-V3 in small: MLA, a dense first layer, routed + shared experts, the sigmoid router
# with its expert bias and group limit, one MTP depth
DEEPSEEK = dict(
    LLAMA,
    num_layers=3,
    ffn_hidden_size=48,
    seq_length=16,
    vocab_size=96,
    layernorm_epsilon=1e-6,
    untie_embeddings_and_output_weights=True,
    **mla_fields(16, 12, 8, 4, 8),
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=8,
    mscale_all_dim=1.0,
    num_experts=8,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
    moe_router_topk=4,
    moe_layer_freq="([0]*1+[1]*2)",
    **V3_ROUTER,
    moe_router_bias_update_rate=0.02,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    mtp_num_layers=1,
)


def tiny_gpt(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def small_gpt(**overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, **overrides})


def tiny_mla(**overrides) -> ModelConfig:
    return small_gpt(**{**MLA, **overrides})


def tiny_moe(**overrides) -> ModelConfig:
    """4 experts, 2 per token, on the small GPT."""
    return small_gpt(**{"num_experts": 4, "moe_router_topk": 2, **overrides})


def tiny_deepseek(**overrides) -> ModelConfig:
    return small_gpt(**{**DEEPSEEK, **overrides})

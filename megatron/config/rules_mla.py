"""Rules of multi-latent attention (--multi-latent-attention & co.); each setting's own limits
are declared on it (megatron.config.schema_model_mla)."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.schema import ModelConfig
from megatron.config.schema_model_mla import MLA_DEFAULTS, YARN_DEFAULTS


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_mla_model(m: ModelConfig, tp: int = 1) -> None:
    """The MLA settings among themselves and against the attention flags they replace."""
    if not m.multi_latent_attention:
        _refuse_without_mla(m)
        return
    refused = (
        ("--num-query-groups", m.num_query_groups is not None, "grouped-query attention"),
        ("--kv-channels", m.kv_channels is not None, "a head size for every head"),
        (
            "--apply-query-key-layer-scaling",
            m.apply_query_key_layer_scaling,
            "v1.x's per-layer score scaling",
        ),
    )
    for flag, given, what in refused:
        if given:
            fail(
                flag,
                f"{what} given with --multi-latent-attention, whose keys and values come from "
                "one latent per token (its head sizes are --qk-head-dim, --qk-pos-emb-head-dim "
                "and --v-head-dim)",
                f"drop {flag}, or drop --multi-latent-attention",
            )
    yarn = [name for name, default in YARN_DEFAULTS.items() if getattr(m, name) != default]
    if yarn and m.mla_rope_type == "rope":
        fail(
            _flag(yarn[0]),
            "a YaRN setting given with --rope-type rope (plain RoPE takes none)",
            "pass --rope-type yarn (multi-latent attention's default), or drop it",
        )
    if m.qk_rope_dim % 2:
        fail(
            "--qk-pos-emb-head-dim",
            f"{m.qk_rope_dim} is odd: RoPE rotates pairs of dimensions",
            "use an even size (DeepSeek-V3: 64)",
        )
    if m.num_attention_heads % tp:
        fail(
            "--num-attention-heads",
            f"{m.num_attention_heads} multi-latent attention heads cannot be split over "
            f"--tensor-model-parallel-size {tp} (q_b_proj / kv_b_proj are split by heads)",
            "use a head count divisible by the tensor-parallel size, or a smaller TP size",
        )


def _refuse_without_mla(m: ModelConfig) -> None:
    given = [name for name in (*MLA_DEFAULTS, "q_lora_rank") if getattr(m, name) is not None]
    given += [name for name, default in YARN_DEFAULTS.items() if getattr(m, name) != default]
    if m.rope_type == "yarn":
        given.append("rope_type")
    if given:
        fail(
            _flag(given[0]),
            "a setting of multi-latent attention (or of its YaRN RoPE) given without "
            "--multi-latent-attention",
            "add --multi-latent-attention, or drop it",
        )
    if m.rope_type == "rope" and m.position_embedding_type != "rope":
        fail(
            "--rope-type rope",
            f"the model has --position-embedding-type {m.position_embedding_type}, no RoPE",
            "add --position-embedding-type rope, or drop --rope-type",
        )

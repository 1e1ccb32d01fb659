"""The multi-latent attention settings of the model (DeepSeek-V2/V3; Megatron-core's flag names).

They are fields of `ModelConfig` (declared here for size; `ModelConfig` derives from
`MLASettings`), so checkpoints record them: the ranks and head sizes change the weights'
shapes, the YaRN settings what a loaded model computes. The head sizes default to None so a
rule can refuse them without --multi-latent-attention; under it they take Megatron-LM's
defaults (`kv_rank`, `qk_nope_dim`, ...). Rules between settings: megatron.config.rules_mla.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting

# Megatron-LM's defaults of the MLA sizes (megatron/training/arguments.py, _add_mla_args).
MLA_DEFAULTS = {
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
}

# YaRN's settings and their defaults: a changed one needs MLA's RoPE (the only one taking it)
YARN_DEFAULTS = {
    "rotary_scaling_factor": 1.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}


@dataclass(frozen=True)
class MLASettings(Section):
    """Multi-latent attention: queries and keys/values through low-rank latents, RoPE on a
    decoupled part of each head only (megatron/model/attention/mla.py, docs/deepseek.md)."""

    multi_latent_attention: bool = setting(
        False,
        "multi-latent attention (DeepSeek-V2/V3) instead of multi-head / grouped-query "
        "attention: keys and values from one compressed latent per token, which is what "
        "generation caches",
    )
    q_lora_rank: int | None = setting(
        None,
        "rank of the query latent: h -> q_lora_rank (q_a_proj, RMSNorm) -> heads (q_b_proj); "
        "default: none, a plain query projection h -> heads (q_proj)",
        min=1,
    )
    kv_lora_rank: int | None = setting(
        None, "rank of the key/value latent (kv_a_proj_with_mqa) (default 32 under MLA)", min=1
    )
    qk_head_dim: int | None = setting(
        None,
        "query/key head size without position embedding; a query/key head is qk-head-dim + "
        "qk-pos-emb-head-dim (default 128 under MLA)",
        min=1,
    )
    qk_pos_emb_head_dim: int | None = setting(
        None,
        "the decoupled RoPE part of each query/key head; the key's is one per token, shared "
        "by the heads (default 64 under MLA)",
        min=2,
    )
    v_head_dim: int | None = setting(None, "value head size (default 128 under MLA)", min=1)
    rope_type: str | None = setting(
        None,
        "RoPE of multi-latent attention: rope, or yarn (its frequencies and attention "
        "factor from --rotary-scaling-factor & co.); default: yarn under MLA, as Megatron-LM",
        choices=("rope", "yarn"),
    )
    rotary_scaling_factor: float = setting(
        1.0, "YaRN's context extension factor s (HF rope_scaling factor; 1: plain RoPE)", min=1
    )
    original_max_position_embeddings: int = setting(
        4096, "YaRN: the context length the model was pretrained with", min=1
    )
    beta_fast: float = setting(32.0, "YaRN: rotations below which a frequency is interpolated")
    beta_slow: float = setting(1.0, "YaRN: rotations above which a frequency is kept")
    mscale: float = setting(
        1.0,
        "YaRN: cos/sin scaled by (0.1 mscale ln s + 1) / (0.1 mscale-all-dim ln s + 1)",
        min=0,
    )
    mscale_all_dim: float = setting(
        0.0,
        "YaRN: the softmax scale is multiplied by (0.1 mscale-all-dim ln s + 1)^2 (0: not)",
        min=0,
    )

    def _mla_size(self, name: str) -> int:
        value = getattr(self, name)
        return MLA_DEFAULTS[name] if value is None else value

    @property
    def kv_rank(self) -> int:
        return self._mla_size("kv_lora_rank")

    @property
    def qk_nope_dim(self) -> int:
        return self._mla_size("qk_head_dim")

    @property
    def qk_rope_dim(self) -> int:
        return self._mla_size("qk_pos_emb_head_dim")

    @property
    def v_dim(self) -> int:
        return self._mla_size("v_head_dim")

    @property
    def mla_rope_type(self) -> str:
        return self.rope_type or "yarn"

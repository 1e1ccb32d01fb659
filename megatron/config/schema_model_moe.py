"""The mixture-of-experts settings of the model (Megatron-core's flag names).

They are fields of `ModelConfig` (declared here for size; `ModelConfig` derives from
`MoESettings`), so checkpoints record them: the expert count and widths change the weights'
shapes, and the router settings change what a loaded model computes. The run-time choices that
do not (expert parallelism, the token dispatcher, grouped GEMMs) live in `ParallelConfig` and
`KernelConfig`. Rules between settings are in megatron.config.rules (`validate_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting
from megatron.config.layer_pattern import expand_layer_freq


@dataclass(frozen=True)
class MoESettings(Section):
    """Mixture of experts: a router and E experts replace the MLP of every k-th layer."""

    num_experts: int | None = setting(
        None,
        "experts per MoE layer (E); the MLP of every --moe-layer-freq-th layer becomes a "
        "router + E experts (default: no MoE, a dense model)",
        min=1,
    )
    moe_layer_freq: str = setting(
        "1",
        "which layers are MoE: an integer k (layer i, 0-based, is MoE when i % k == 0; 1: "
        "every layer) or a Python-style list of 0/1 per layer such as '([0]*3+[1]*58)' (first "
        "3 dense, as DeepSeek-V3), its length --num-layers; dense layers use --ffn-hidden-size",
        metavar="K|PATTERN",
    )
    moe_ffn_hidden_size: int | None = setting(
        None, "inner width of each expert's MLP (default: --ffn-hidden-size)", min=1
    )
    moe_shared_expert_intermediate_size: int | None = setting(
        None,
        "inner width of the shared expert, an MLP every token goes through besides its routed "
        "experts (default: none)",
        min=1,
    )
    moe_shared_expert_gate: bool = setting(
        False, "scale the shared expert's output by sigmoid(x w) (Qwen2-MoE's gate)"
    )
    moe_router_topk: int = setting(2, "experts each token is sent to (k)", min=1)
    moe_router_score_function: str = setting(
        "softmax",
        "router scores from the fp32 logits: softmax, or sigmoid (DeepSeek-V3: the top k "
        "normalized to sum 1 when k > 1)",
        choices=("softmax", "sigmoid"),
    )
    moe_router_topk_scaling_factor: float | None = setting(
        None,
        "multiply the top-k routing probabilities by this factor (DeepSeek-V3's "
        "routed_scaling_factor; default: none, 1)",
        above=0,
    )
    moe_router_num_groups: int | None = setting(
        None,
        "split the E experts into this many groups for group-limited routing (DeepSeek-V3's "
        "n_group; device- or node-limited routing: the EP size or the nodes of the EP group)",
        min=1,
    )
    moe_router_group_topk: int | None = setting(
        None,
        "group-limited routing: each token picks its experts from the top this-many groups, "
        "a group scored by the sum of its top (k / this) expert scores (DeepSeek-V3's "
        "topk_group; default: no group limit)",
        min=1,
    )
    moe_router_enable_expert_bias: bool = setting(
        False,
        "auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert fp32 bias added to the "
        "sigmoid scores for the top-k selection only, moved after each step by "
        "--moe-router-bias-update-rate x sign(mean load - expert load) over the global batch",
    )
    moe_router_bias_update_rate: float = setting(
        1e-3,
        "the expert bias's step per optimizer step (--moe-router-enable-expert-bias)",
        min=0,
    )
    moe_router_pre_softmax: bool = setting(
        False,
        "softmax over all E logits before the top-k, probabilities not renormalized "
        "(Qwen2-MoE); default: softmax over the k chosen logits (Mixtral)",
    )
    moe_router_load_balancing_type: str = setting(
        "aux_loss",
        "load balancing: aux_loss (switch-transformer loss over the micro batch), seq_aux_loss "
        "(the same per sequence, averaged), none",
        choices=("aux_loss", "seq_aux_loss", "none"),
    )
    moe_aux_loss_coeff: float = setting(
        0.0, "weight of the load-balancing loss (0: not computed)", min=0
    )
    moe_z_loss_coeff: float | None = setting(
        None, "weight of the router z-loss, mean(logsumexp(logits)^2) (default: none)", min=0
    )
    moe_expert_capacity_factor: float | None = setting(
        None,
        "capacity per expert = ceil(tokens x k / E x factor) of this rank's tokens; the "
        "assignments over it are dropped (default: dropless)",
        above=0,
    )
    moe_token_drop_policy: str = setting(
        "probs",
        "with a capacity: which assignments an expert keeps, the highest router probabilities "
        "(probs) or the first tokens (position)",
        choices=("probs", "position"),
    )

    def __post_init__(self) -> None:
        # --moe-layer-freq 2 from a file or an older checkpoint (an int): one spelling, "2"
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            object.__setattr__(self, "moe_layer_freq", str(freq))
        elif isinstance(freq, str):
            object.__setattr__(self, "moe_layer_freq", "".join(freq.split()))
        super().__post_init__()

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense one (--num-layers entries; a pattern of
        another length is refused by megatron.config.rules_moe)."""
        if not self.moe:
            return (0,) * self.num_layers
        return expand_layer_freq(self.moe_layer_freq, self.num_layers)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) has experts instead of a dense MLP."""
        pattern = self.moe_layer_pattern
        return self.moe and i < len(pattern) and pattern[i] == 1

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers)) if self.moe else 0

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

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


@dataclass(frozen=True)
class MoESettings(Section):
    """Mixture of experts: a router and E experts replace the MLP of every k-th layer."""

    num_experts: int | None = setting(
        None,
        "experts per MoE layer (E); the MLP of every --moe-layer-freq-th layer becomes a "
        "router + E experts (default: no MoE, a dense model)",
        min=1,
    )
    moe_layer_freq: int = setting(
        1, "layer i (0-based) is an MoE layer when i % k == 0 (1: every layer)", min=1
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
        "router scores from the fp32 logits: softmax, or sigmoid (the top-k normalized to sum 1)",
        choices=("softmax", "sigmoid"),
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

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) has experts instead of a dense MLP."""
        return self.moe and i % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers)) if self.moe else 0

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

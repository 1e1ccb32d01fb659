"""Rules of mixture of experts (--num-experts & co.) and expert parallelism (--expert-model-
parallel-size); each setting's own limits are declared on it (megatron.config.schema_model_moe)."""

from __future__ import annotations

import math

from megatron.config.declare import fail
from megatron.config.layer_pattern import parse_layer_freq
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig, ModelConfig


def validate_moe_model(m: ModelConfig, tp: int = 1) -> None:
    """The MoE settings among themselves (what a checkpoint's model needs at any layout)."""
    if not m.moe:
        changed = [
            flag
            for flag, given in (
                ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size is not None),
                ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                ("--moe-expert-capacity-factor", m.moe_expert_capacity_factor is not None),
                ("--moe-aux-loss-coeff", m.moe_aux_loss_coeff > 0),
                ("--moe-z-loss-coeff", m.moe_z_loss_coeff is not None),
                ("--moe-layer-freq", m.moe_layer_freq != "1"),
                ("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias),
                ("--moe-router-num-groups", m.moe_router_num_groups is not None),
                ("--moe-router-group-topk", m.moe_router_group_topk is not None),
                ("--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor),
            )
            if given
        ]
        if changed:
            fail(
                changed[0],
                "given without --num-experts (the model has no experts)",
                "add --num-experts E or drop it",
            )
        return
    if m.moe_router_topk > m.num_experts:
        fail(
            "--moe-router-topk",
            f"{m.moe_router_topk} experts per token but only --num-experts {m.num_experts}",
            f"use a top-k of at most {m.num_experts} (or more experts)",
        )
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        fail(
            "--moe-router-pre-softmax",
            "given with --moe-router-score-function sigmoid",
            "drop --moe-router-pre-softmax or use the softmax score function",
        )
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        fail(
            "--moe-router-enable-expert-bias",
            f"given with --moe-router-score-function {m.moe_router_score_function}; the "
            "auxiliary-loss-free bias is added to sigmoid scores (Megatron-core refuses it too)",
            "add --moe-router-score-function sigmoid (DeepSeek-V3's router)",
        )
    if m.moe_router_bias_update_rate != 1e-3 and not m.moe_router_enable_expert_bias:
        fail(
            "--moe-router-bias-update-rate",
            f"{m.moe_router_bias_update_rate} given without --moe-router-enable-expert-bias "
            "(there is no bias to update)",
            "add --moe-router-enable-expert-bias (with --moe-router-score-function sigmoid) "
            "or drop the rate",
        )
    validate_router_groups(m)
    validate_layer_freq(m)
    shared = m.moe_shared_expert_intermediate_size
    if m.moe_shared_expert_gate and shared is None:
        fail(
            "--moe-shared-expert-gate",
            "gates the shared expert, which is off",
            "add --moe-shared-expert-intermediate-size N or drop the gate",
        )
    if shared is not None and shared % tp:
        fail(
            "--moe-shared-expert-intermediate-size",
            f"{shared} cannot be split over --tensor-model-parallel-size {tp}",
            "use a multiple of the tensor-parallel size",
        )


def validate_router_groups(m: ModelConfig) -> None:
    """Group-limited routing: G groups that split the experts, g <= G of them per token, k a
    multiple of g that fits in g groups (Megatron-core's rules)."""
    groups, top = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and top is None:
        return
    if top is None:
        fail(
            "--moe-router-num-groups",
            f"{groups} given without --moe-router-group-topk (the groups would limit nothing)",
            "add --moe-router-group-topk g (the groups each token may use) or drop it",
        )
    if groups is None:
        fail(
            "--moe-router-group-topk",
            "given without --moe-router-num-groups",
            "add --moe-router-num-groups G (G divides --num-experts)",
        )
    e, k = m.num_experts, m.moe_router_topk
    if e % groups:
        fail(
            "--moe-router-num-groups",
            f"{groups} groups do not divide --num-experts {e}",
            f"use a divisor of {e} (DeepSeek-V3: 256 experts in 8 groups)",
        )
    if top > groups:
        fail(
            "--moe-router-group-topk",
            f"{top} groups per token but only --moe-router-num-groups {groups}",
            f"use at most {groups}",
        )
    if k % top or k // top > e // groups:
        fail(
            "--moe-router-topk",
            f"{k} experts per token cannot be taken evenly from --moe-router-group-topk {top} "
            f"groups of {e // groups} experts (each group is scored by its top k / g experts)",
            f"use a top-k that is a multiple of {top} and at most {top * (e // groups)}",
        )


def validate_layer_freq(m: ModelConfig) -> None:
    """--moe-layer-freq: an int k <= --num-layers, or a 0/1 pattern of --num-layers entries
    with at least one MoE layer; layers that share weights (--num-unique-layers) alike."""
    freq = parse_layer_freq(m.moe_layer_freq)
    if isinstance(freq, int):
        if freq > m.num_layers:
            fail(
                "--moe-layer-freq",
                f"{freq} exceeds --num-layers {m.num_layers}",
                f"use at most {m.num_layers} (or a pattern such as '([0]*1+[1]*"
                f"{m.num_layers - 1})')",
            )
        return
    if len(freq) != m.num_layers:
        fail(
            "--moe-layer-freq",
            f"the pattern has {len(freq)} entries but --num-layers is {m.num_layers}",
            f"give one 0 (dense) or 1 (MoE) per layer, e.g. '([0]*{min(3, m.num_layers - 1)}"
            f"+[1]*{m.num_layers - min(3, m.num_layers - 1)})'",
        )
    if not any(freq):
        fail(
            "--moe-layer-freq",
            "the pattern has no MoE layer (all 0) but --num-experts is given",
            "put a 1 for each MoE layer, or drop --num-experts for a dense model",
        )
    for i in range(m.num_layers):
        owner = m.layer_owner(i)
        if freq[i] != freq[owner]:
            fail(
                "--moe-layer-freq",
                f"layer {i} runs the weights of layer {owner} (--num-unique-layers) but one is "
                "MoE and the other dense",
                "give layers that share weights the same entry",
            )


def validate_moe(cfg: MegatronConfig) -> None:
    """MoE and expert parallelism against the layout and the other features of the run."""
    m, par = cfg.model, cfg.parallel
    ep, dp = par.expert_model_parallel_size, par.data_parallel_size
    validate_moe_model(m, par.tensor_model_parallel_size)
    etp = par.expert_tensor_parallel_size
    if etp is not None and etp > 1 and not m.moe:
        fail(
            "--expert-tensor-parallel-size",
            f"{etp} given without --num-experts (the model has no experts to split)",
            "add --num-experts or drop the flag",
        )
    if ep > 1 and not m.moe:
        fail(
            "--expert-model-parallel-size",
            f"{ep} given without --num-experts (the model has no experts to split)",
            "add --num-experts (a multiple of the EP size) or drop the flag",
        )
    if not m.moe:
        for flag, given in (
            ("--moe-grouped-gemm", cfg.kernels.moe_grouped_gemm),
            ("--moe-token-dispatcher-type", par.moe_token_dispatcher_type != "alltoall"),
        ):
            if given:
                fail(
                    flag,
                    "given without --num-experts (no experts to compute)",
                    "add --num-experts E or drop it",
                )
        return
    if m.num_experts % ep:
        fail(
            "--num-experts",
            f"{m.num_experts} experts cannot be split over --expert-model-parallel-size {ep}",
            f"use a multiple of {ep} experts, or an EP size that divides {m.num_experts}",
        )
    cp, tp, pp = (
        par.context_parallel_size,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
    )
    _validate_expert_tp(m, par.expert_tp_size, tp)
    groups = m.moe_router_num_groups
    if groups is not None and groups % ep and ep % groups:
        fail(
            "--moe-router-num-groups",
            f"{groups} groups of {m.num_experts // groups} experts do not line up with "
            f"--expert-model-parallel-size {ep} ({m.num_experts // ep} experts per EP rank): "
            "group-limited routing is meant to bound the EP ranks (devices, nodes) a token "
            "reaches, so a group must hold whole EP ranks or sit within one",
            f"use a number of groups that divides or is a multiple of {ep} (device-limited "
            f"routing: {ep}), or an EP size that does",
        )
    if (dp * cp) % ep:
        fail(
            "--expert-model-parallel-size",
            f"{ep} does not divide the data-parallel x context-parallel size {dp} x {cp} "
            f"(world {par.world_size} / (TP x PP)); expert-parallel ranks are carved from those",
            f"use an EP size dividing {dp * cp}, or launch a multiple of "
            f"{math.lcm(ep, cp) * tp * pp} processes",
        )
    refuse_pairs(cfg, "--num-experts")  # megatron.config.rules_pairs


def _validate_expert_tp(m: ModelConfig, etp: int, tp: int) -> None:
    """ETP is 1 (experts replicated over TP) or TP (each expert's FFN split over the TP group);
    the expert width must split over it."""
    if etp not in (1, tp):
        fail(
            "--expert-tensor-parallel-size",
            f"{etp} with --tensor-model-parallel-size {tp}: the experts are split over the TP "
            "group or not at all (Megatron-core's expert-tensor-parallel groups carved from "
            "the data-parallel ranks are not supported)",
            f"use {tp} (the default) or 1",
        )
    if m.expert_ffn_size % etp:
        flag = "--moe-ffn-hidden-size" if m.moe_ffn_hidden_size else "--ffn-hidden-size"
        fail(
            flag,
            f"the expert width {m.expert_ffn_size} cannot be split over "
            f"--expert-tensor-parallel-size {etp}",
            f"use a multiple of {etp}, or --expert-tensor-parallel-size 1",
        )

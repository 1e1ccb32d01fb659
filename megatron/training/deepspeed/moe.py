"""Mixture of experts under --deepspeed: our expert groups handed to DeepSpeed's MoE support.

DeepSpeed (ZeRO 0-2, its bf16 and fp16 optimizers) treats a parameter with `allreduce = False`
and `group_name = "ep_size_<EP>"` as an expert: its gradient is averaged over the
expert-data-parallel group registered under that name in `deepspeed.utils.groups` (divided by
the whole DP size, as ours), ZeRO partitions it over that group, and the gradient norm sums it
over the EP group. The engine only looks for that when the model holds a `deepspeed.moe.layer.MoE`
module, and that module's `set_deepspeed_parallelism` is where DeepSpeed builds the groups.

DeepSpeed's own group builder does not lay ranks out like our grid once TP > 1 (experts
replicated over TP: it puts TP peers into one EP group), so instead of letting it build groups,
`ExpertGroups` (an MoE module with no parameters, added to the model) registers OUR EP and
expert-data-parallel groups under the name, and every expert parameter (`expert_parallel`) is
marked. At EP = 1 nothing is marked: the experts are then plain DP-replicated weights.

Checkpoints: DeepSpeed saves expert weights only for its own MoE layer's parameter names and
writes the module's weights from DP rank 0 alone, which holds EP rank 0's experts. So the
expert-DP rank 0 of each EP rank (every TP rank) also writes its experts to
`expp_rank_<e>_mp_rank_<tp>_experts.pt` in the tag's folder, read back after the engine loads.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint.storage import CheckpointError
from megatron.model.moe import moe_layers
from megatron.mpu.grads import clip_grad_norm


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name for the groups of expert parallel size `ep`."""
    return f"ep_size_{ep}"


def _expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)]


def expert_parallel_model(model: nn.Module, state) -> bool:
    """Whether DeepSpeed must treat experts apart (MoE layers with EP > 1)."""
    return state.ep_size > 1 and bool(moe_layers(model))


def prepare_experts(model: nn.Module, state) -> None:
    """Before deepspeed.initialize: mark the expert parameters and add the MoE marker that makes
    the engine (and its ZeRO / bf16 optimizer) reduce them over our expert-DP group."""
    from deepspeed.moe.layer import MoE

    class ExpertGroups(MoE):
        """The MoE module DeepSpeed looks for, without parameters: `set_deepspeed_parallelism`
        (called by the engine) registers our groups instead of building DeepSpeed's. Its
        num_local_experts is 0, so DeepSpeed's expert-file save/load finds nothing to do."""

        def __init__(self, num_experts: int):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size = num_experts, state.ep_size
            self.num_local_experts = 0
            self.expert_group_name = expert_group_name(state.ep_size)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            register_expert_groups(state)

        def forward(self, *args):
            raise RuntimeError("ExpertGroups only tells DeepSpeed the expert groups")

    name = expert_group_name(state.ep_size)
    for _, p in _expert_params(model):
        p.allreduce, p.group_name = False, name
    (_, layer), *_ = moe_layers(model)
    model.add_module("deepspeed_expert_groups", ExpertGroups(layer.cfg.num_experts))


def register_expert_groups(state) -> None:
    """Our EP and expert-DP groups in deepspeed.utils.groups under "ep_size_<EP>" (what
    DeepSpeed's gradient reduction, ZeRO partitioning, norms and checkpoints look up)."""
    from deepspeed.utils import groups

    name = expert_group_name(state.ep_size)
    groups._EXPERT_PARALLEL_GROUP[name] = state.ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(state.ep_ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = state.expert_dp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(
        state.expert_dp_group
    )


def split_expert_param_groups(param_groups: list[dict]) -> list[dict]:
    """Our optimizer's groups, each split into its dense and its expert part (the latter
    flagged `moe`), as DeepSpeed's ZeRO and bf16 optimizers require with MoE."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    for i, g in enumerate(param_groups):
        g.setdefault("name", f"group{i}")
    return split_params_into_different_moe_groups_for_optimizer(param_groups)


def count_experts_once_when_clipping(engine, optimizer, state) -> None:
    """fp32 without ZeRO: DeepSpeed clips with each rank's own norm averaged over DP, which is
    not the model's norm once ranks hold different experts. Clip with ours (experts summed over
    EP, counted once) and report that norm as the engine's global grad norm."""
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def clip_fp32_gradients():
        norm = clip_grad_norm(
            params,
            engine.gradient_clipping(),
            tp_rank=state.tp_rank,
            model_parallel_group=state.mp_group,
            expert_group=state.ep_group,
        )
        optimizer._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_fp32_gradients


def _experts_file(directory: str, state) -> str:
    name = f"expp_rank_{state.ep_rank}_mp_rank_{state.tp_rank:02d}_experts.pt"
    return os.path.join(directory, name)


def save_experts(model: nn.Module, directory: str, state) -> None:
    """This EP rank's experts, written by its expert-DP rank 0 (one file per EP x TP rank)."""
    if dist.get_rank(state.expert_dp_group) != 0:
        return
    tensors = {n: p.detach().cpu().clone() for n, p in _expert_params(model)}
    torch.save({"experts": tensors}, _experts_file(directory, state))


def check_expert_layout(directory: str, ep_size: int) -> None:
    """Before DeepSpeed loads: the checkpoint's EP size (its expert files; none: EP 1) is this
    run's. DeepSpeed engine checkpoints hold each EP rank's experts as they were cut."""
    ranks = {n.split("_")[2] for n in os.listdir(directory) if n.endswith("_experts.pt")}
    saved = len(ranks) or 1
    if saved != ep_size:
        raise CheckpointError(
            f"{directory}: saved under --deepspeed at --expert-model-parallel-size {saved}, "
            f"resumed at {ep_size}; DeepSpeed engine checkpoints are not re-cut over EP. "
            f"Fix: resume at the EP size it was saved with ({saved})"
        )


def load_experts(engine, directory: str, state, refresh_masters: bool) -> None:
    """After engine.load_checkpoint: this EP rank's experts from its file (DeepSpeed loaded DP
    rank 0's into the module). With the optimizer state loaded, DeepSpeed's fp32 master copies
    are this rank's already (ZeRO files are per rank, DeepSpeed's MoE optimizer file per EP
    rank); without it (`refresh_masters`) they are refreshed from the restored weights."""
    saved = torch.load(_experts_file(directory, state), map_location="cpu", weights_only=True)
    with torch.no_grad():
        for n, p in _expert_params(engine.module):
            p.copy_(saved["experts"][n])
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh_masters and refresh is not None:
        refresh()

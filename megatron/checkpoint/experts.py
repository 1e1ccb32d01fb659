"""MoE experts in checkpoints: stored whole (all E experts), whatever the EP size.

With expert parallelism each EP rank holds E / EP experts of every MoE layer (the stacked
expert tensors' dim 0). At save, the expert tensors of the model, of the plain optimizer's
moments and fp32 masters, are all-gathered over the EP group into the full (E, ...) tensors, so
a shard looks as at EP = 1: any EP size resumes from it (each rank keeps its slice,
`expert_parallel` dim 0; resharding on load to another TP x PP reads just those rows,
megatron.checkpoint.reshard_load), and conversion, Hugging Face export and the inference
tools (EP = 1) need to know nothing of EP. The distributed optimizer's ranges of an expert
tensor are saved in the coordinates of the whole tensor (`expert_offset`), which its ranges
at any EP size are cut from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.mpu import ParallelState
from megatron.mpu.utils import group_size


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """State-dict name -> parameter for the EP-split expert tensors of `model`."""
    module = getattr(model, "module", model)
    out = {}
    for chunk in getattr(module, "chunks", [module]):
        for name, p in chunk.named_parameters():
            if getattr(p, "expert_parallel", False):
                out[name] = p
    return out


def expert_offset(param: torch.Tensor, state: ParallelState) -> int:
    """Where this rank's slice of an expert tensor starts in the flattened whole tensor."""
    if not getattr(param, "expert_parallel", False):
        return 0
    return state.ep_rank * param.numel()


def _gather(t: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if group_size(state.ep_group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(state.ep_size)]
    dist.all_gather(parts, t.contiguous(), group=state.ep_group)
    return torch.cat(parts)


def _local(t: torch.Tensor, local_rows: int, state: ParallelState, name: str) -> torch.Tensor:
    if t.size(0) == local_rows:  # saved at this EP size's slice size (EP = 1 and E / EP = E)
        return t
    if t.size(0) != local_rows * state.ep_size:
        raise ValueError(
            f"{name}: the checkpoint holds {t.size(0)} experts, this model {local_rows} x EP "
            f"{state.ep_size}; load it with the --num-experts it was saved with"
        )
    return t.chunk(state.ep_size)[state.ep_rank]


def gather_experts(sd: dict, model: nn.Module, state: ParallelState) -> dict:
    """A model state dict with every expert tensor whole (every EP rank must call this)."""
    params = expert_parameters(model)
    if state.ep_size == 1 or not params:
        return sd
    return {k: _gather(v, state) if k in params else v for k, v in sd.items()}


def local_experts(sd: dict, model: nn.Module, state: ParallelState) -> dict:
    """A saved model state dict cut to this EP rank's experts."""
    params = expert_parameters(model)
    return {k: _local(v, params[k].size(0), state, k) if k in params else v for k, v in sd.items()}


def _expert_positions(model: nn.Module, order: list) -> dict[int, int]:
    """Position in the plain optimizer's parameter order -> rows of that expert tensor here."""
    ids = {id(p) for p in expert_parameters(model).values()}
    return {i: p.size(0) for i, p in enumerate(order) if id(p) in ids}


def gather_optimizer_experts(sd: dict, model: nn.Module, order: list, state) -> dict:
    """The plain optimizer's state dict with the moments and masters of experts whole."""
    positions = _expert_positions(model, order)
    if state.ep_size == 1 or not positions:
        return sd
    torch_sd = sd["optimizer"]
    per_param = {
        i: {k: _gather(v, state) if i in positions and v.ndim else v for k, v in s.items()}
        for i, s in torch_sd["state"].items()
    }
    out = {**sd, "optimizer": {**torch_sd, "state": per_param}}
    if "fp32_from_fp16_params" in sd:
        masters = sd["fp32_from_fp16_params"]
        out["fp32_from_fp16_params"] = [
            _gather(m, state) if i in positions else m for i, m in enumerate(masters)
        ]
    return out


def local_optimizer_experts(sd: dict, model: nn.Module, order: list, state) -> dict:
    """A saved plain optimizer state dict cut to this EP rank's experts."""
    positions = _expert_positions(model, order)
    if not positions:
        return sd
    torch_sd = sd["optimizer"]

    def cut(i, v, what):
        return _local(v, positions[i], state, what) if i in positions and v.ndim else v

    per_param = {
        i: {k: cut(i, v, f"optimizer state {i}.{k}") for k, v in s.items()}
        for i, s in torch_sd["state"].items()
    }
    out = {**sd, "optimizer": {**torch_sd, "state": per_param}}
    if "fp32_from_fp16_params" in sd:
        out["fp32_from_fp16_params"] = [
            cut(i, m, f"fp32 master {i}") for i, m in enumerate(sd["fp32_from_fp16_params"])
        ]
    return out

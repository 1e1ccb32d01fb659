"""MoE experts in checkpoints: stored whole (all E experts), whatever the EP and ETP sizes.

With expert parallelism each EP rank holds E / EP experts of every MoE layer (the stacked
expert tensors' dim 0). At save, the expert tensors of the model, of the plain optimizer's
moments and fp32 masters, are all-gathered over the EP group into the full (E, ...) tensors, so
a shard looks as at EP = 1: any EP size resumes from it (each rank keeps its slice,
`expert_parallel` dim 0; resharding on load to another TP x PP reads just those rows,
megatron.checkpoint.reshard_load), and conversion, Hugging Face export and the inference
tools (EP = 1) need to know nothing of EP. The distributed optimizer's ranges of an expert
tensor are saved in the coordinates of the whole tensor (`expert_offset`), which its ranges
at any EP size are cut from.

Expert tensor parallelism (ETP = TP > 1): each TP rank also holds only its shard of every
expert's FFN (`expert_partition`: weight1 and bias1 along their last dim, [gate_r; up_r] under
SwiGLU, weight2 along dim 1; bias2 whole). Saves gather over ETP too, so the files are the
same at any ETP, and loads cut both ways (`cut_whole`). A distributed optimizer range of an
ETP shard is not contiguous in the whole tensor: it is saved with the whole tensor's flat
index of each element (`whole_index`, an "index" entry beside "range"), every ETP rank's range
gathered into each TP rank's file, and any layout picks its elements from those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.mpu.expert_shards import cut_whole, etp_split, whole_shape
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.utils import group_size, unshard


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
    """Where this rank's slice of an expert tensor not split over ETP starts in the flattened
    whole tensor (`whole_index` for one that is)."""
    if not getattr(param, "expert_parallel", False):
        return 0
    return state.ep_rank * param.numel()


def whole_index(param: torch.Tensor, state: ParallelState, lo: int, hi: int) -> torch.Tensor:
    """(hi - lo,) the flat indices in the whole tensor of elements [lo, hi) of this rank's
    flattened expert tensor (EP rows and ETP columns); increasing."""
    return whole_flat_index(
        tuple(param.shape), etp_split(param), state.ep_rank, state.etp_size, state.etp_rank, lo, hi
    )


def whole_flat_index(shape, split, ep_rank: int, etp: int, etp_rank: int, lo: int, hi: int):
    """`whole_index` from the local shape, the ETP (dim, stride) split (None: not split) and
    the rank's EP and ETP positions."""
    full = list(shape)
    if split is not None:
        full[split[0]] *= etp
    coords = list(torch.unravel_index(torch.arange(lo, hi), tuple(shape)))
    coords[0] = coords[0] + ep_rank * shape[0]
    if split is not None:  # local column c of block j -> that column of rank etp_rank's part
        dim, stride = split
        block = shape[dim] // stride
        j, c = coords[dim] // block, coords[dim] % block
        coords[dim] = j * (full[dim] // stride) + etp_rank * block + c
    full[0] = -1  # the row count does not enter the flat index
    flat = torch.zeros(hi - lo, dtype=torch.long)
    for c, n in zip(coords, full, strict=True):
        flat = flat * max(n, 1) + c
    return flat


def saved_elements(entry: dict) -> tuple[int, slice | torch.Tensor]:
    """(how many elements a saved distributed-optimizer entry holds, where they sit in the
    flat saved tensor): its "index" (an ETP-split expert range) or its "range"."""
    if "index" in entry:
        return entry["index"].numel(), entry["index"]
    lo, hi = entry["range"]
    return hi - lo, slice(lo, hi)


ENTRY_PLACES = ("range", "index")  # the keys of a saved entry that are not optimizer state


def _gather(t: torch.Tensor, state: ParallelState, param: torch.Tensor | None) -> torch.Tensor:
    """The whole tensor of this rank's part `t` of expert tensor `param`: all-gathered over
    ETP (when split) and EP."""
    split = etp_split(param) if param is not None else None
    if split is not None:
        parts = [torch.empty_like(t) for _ in range(state.etp_size)]
        dist.all_gather(parts, t.contiguous(), group=state.etp_group)
        t = unshard(parts, split[0], split[1])
    if group_size(state.ep_group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(state.ep_size)]
    dist.all_gather(parts, t.contiguous(), group=state.ep_group)
    return torch.cat(parts)


def _local(t: torch.Tensor, param: torch.Tensor, state: ParallelState, name: str) -> torch.Tensor:
    if t.shape == param.shape:  # saved at this rank's size (EP = ETP = 1, or one expert)
        return t
    full = whole_shape(param, state)
    if list(t.shape) != full:
        raise ValueError(
            f"{name}: the checkpoint holds experts of shape {tuple(t.shape)}, this model "
            f"{tuple(full)} (EP {state.ep_size}, ETP {state.etp_size}); load it with the "
            "--num-experts and expert width it was saved with"
        )
    return cut_whole(t, param, state)


def _splits(state: ParallelState) -> bool:
    return state.ep_size > 1 or state.etp_size > 1


def gather_experts(sd: dict, model: nn.Module, state: ParallelState) -> dict:
    """A model state dict with every expert tensor whole (every EP rank must call this)."""
    params = expert_parameters(model)
    if not _splits(state) or not params:
        return sd
    return {k: _gather(v, state, params[k]) if k in params else v for k, v in sd.items()}


def local_experts(sd: dict, model: nn.Module, state: ParallelState) -> dict:
    """A saved model state dict cut to this rank's experts (and ETP shard)."""
    params = expert_parameters(model)
    return {k: _local(v, params[k], state, k) if k in params else v for k, v in sd.items()}


def _expert_positions(model: nn.Module, order: list) -> dict[int, torch.Tensor]:
    """Position in the plain optimizer's parameter order -> that expert parameter."""
    ids = {id(p) for p in expert_parameters(model).values()}
    return {i: p for i, p in enumerate(order) if id(p) in ids}


def gather_optimizer_experts(sd: dict, model: nn.Module, order: list, state) -> dict:
    """The plain optimizer's state dict with the moments and masters of experts whole."""
    positions = _expert_positions(model, order)
    if not _splits(state) or not positions:
        return sd
    torch_sd = sd["optimizer"]

    def whole(i, v):
        return _gather(v, state, positions[i]) if i in positions and v.ndim else v

    per_param = {i: {k: whole(i, v) for k, v in s.items()} for i, s in torch_sd["state"].items()}
    out = {**sd, "optimizer": {**torch_sd, "state": per_param}}
    if "fp32_from_fp16_params" in sd:
        masters = sd["fp32_from_fp16_params"]
        out["fp32_from_fp16_params"] = [whole(i, m) for i, m in enumerate(masters)]
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

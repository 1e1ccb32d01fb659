"""Small helpers shared by the mpu modules: group sizes, stride-aware (un)sharding, and
handing a mode to the layers of one model (`handed_to`)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# What the parallel layers (and MoE's experts) mark on a parameter: how it is split over TP /
# EP, whether it is shared. Copies of a parameter (fp32 masters, FSDP2's shards) keep them, for
# the grad norm's counting and for resharding.
PARALLEL_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "expert_parallel",
    "expert_partition",
    "expert_tensor_parallel",
)


def group_size(group) -> int:
    """Ranks in `group`; None means no group (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def shard(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`.

    With stride s the dimension holds s stacked blocks (e.g. SwiGLU's [gate; up]); each rank
    takes its 1/size of every block, so the local tensor is [gate_r; up_r].
    """
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard`: rebuild the full tensor from every rank's slice (in rank order)."""
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([p[j] for j in range(stride) for p in per_rank], dim=dim)


@contextlib.contextmanager
def handed_to(model: torch.nn.Module, slot: str, value):
    """Inside, every module of `model` with the attribute `slot` holds `value`; afterwards what
    it held before. How a caller hands a mode to the layers that take it, explicitly and to one
    model only (megatron.mpu.weight_grad's split, megatron.mpu.overlap's hand-over)."""
    taking = [m for m in model.modules() if hasattr(m, slot)]
    before = [getattr(m, slot) for m in taking]
    for m in taking:
        setattr(m, slot, value)
    try:
        yield value
    finally:
        for m, held in zip(taking, before, strict=True):
            setattr(m, slot, held)

"""Where an MoE expert tensor of this rank sits in the whole tensor (all E experts, every
expert-tensor-parallel shard): its EP rank's experts along dim 0 and, with ETP > 1, its ETP
shard along the parameter's `expert_partition` (dim, stride). Shared by initialization
(megatron/model/weights.py: every layout draws the same whole tensor) and checkpoints
(megatron/checkpoint/experts.py: stored whole).
"""

from __future__ import annotations

import torch

from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.utils import shard


def is_etp_split(param: torch.Tensor) -> bool:
    """Whether this run holds only an ETP shard of expert tensor `param`."""
    return bool(getattr(param, "expert_tensor_parallel", False))


def etp_split(param: torch.Tensor) -> tuple[int, int] | None:
    """(dim, stride) along which this run splits `param` over ETP; None when it does not."""
    if not getattr(param, "expert_tensor_parallel", False):
        return None
    return param.expert_partition


def whole_shape(param: torch.Tensor, state: ParallelState) -> list[int]:
    """The shape of the whole expert tensor (all E experts, every ETP shard) `param` is cut
    from."""
    shape = list(param.shape)
    shape[0] *= state.ep_size
    split = etp_split(param)
    if split is not None:
        shape[split[0]] *= state.etp_size
    return shape


def cut_whole(whole: torch.Tensor, param: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's part of a whole expert tensor: its EP rank's experts, its ETP shard."""
    t = whole.chunk(state.ep_size)[state.ep_rank]
    split = etp_split(param)
    if split is not None:
        t = shard(t, split[0], state.etp_rank, state.etp_size, split[1])
    return t

"""Broadcast a batch from TP rank 0 to the rest of its TP group.

Only TP rank 0 reads the data loader; its TP peers need the same tokens. Shapes travel first
(one small int64 tensor), then all tensors flattened into one buffer, so the cost is two
broadcasts however many keys the batch has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.utils import group_size

_MAX_DIMS = 8


def broadcast_data(
    keys: list[str],
    data: dict[str, torch.Tensor] | None,
    dtype: torch.dtype,
    *,
    src_rank: int,
    group,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """`data` (only read on `src_rank`, a global rank) -> the same dict on every rank of `group`."""
    if group_size(group) == 1:
        return {k: data[k].to(device=device, dtype=dtype) for k in keys}
    is_src = dist.get_rank() == src_rank
    sizes = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64, device=device)
    if is_src:
        for i, k in enumerate(keys):
            t = data[k]
            if t.dtype != dtype:
                raise TypeError(f"batch key {k!r} has dtype {t.dtype}, expected {dtype}")
            if t.dim() > _MAX_DIMS:
                raise ValueError(f"batch key {k!r} has {t.dim()} dims; at most {_MAX_DIMS}")
            sizes[i, 0] = t.dim()
            sizes[i, 1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.broadcast(sizes, src_rank, group=group)
    shapes = [tuple(int(d) for d in row[1 : 1 + int(row[0])]) for row in sizes.cpu()]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        flat = torch.cat([data[k].to(device).reshape(-1) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
    dist.broadcast(flat, src_rank, group=group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels, strict=True):
        out[k] = flat[offset : offset + n].view(shape)
        offset += n
    return out

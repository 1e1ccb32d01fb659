"""Whole matrices for an optimizer that needs them (Muon's Newton-Schulz), from each backend's
pieces: `fn(param, whole)` maps a parameter's whole TP-local update to its result (Muon:
s NS(U) of each logical matrix, TP-gathered inside), and each class below runs it over the
updates of one step, in one call on every rank (they run collectives).

    Whole       the plain optimizer: every main is a whole TP-local weight (the same work on
                every DP rank, as Adam's update)
    Sharded     --use-distributed-optimizer: a DP rank holds its shard (flat ranges) of every
                gradient bucket, and the optimizer's state for the same ranges (elementwise, so
                it shards, saves and reshards like Adam's moments). One step, on DP rank r:
        gather   the updates of r's ranges into a zero buffer laid out as the grad buffer,
                 all-gathered bucket by bucket over DP: every rank holds every update
        fn       the matrices r owns (dealt round-robin in decreasing size over the DP ranks)
        scatter  their results into a second zero buffer, reduce-scattered (sum) bucket by
                 bucket: r receives the result of its own ranges. Every element is non-zero on
                 its owner only, so the sum adds zeros and is exact.
                MoE experts are dealt the same way over the expert-DP group, the ranks that hold
                the same experts (EP = DP: each rank its own).
    RowSharded  --use-torch-fsdp2: each parameter's rows split over the DP x CP mesh (FSDP2's
                dim-0 shards, ceil(rows / n) per rank, the last ones shorter). Per matrix, in
                the same order on every rank: its row shards are gathered (padded to equal
                size) on the DP rank that owns it (dealt as above), which runs fn on it whole
                and scatters each rank its rows back.

Each matrix is computed by one DP rank (and, TP-split, by every TP rank of that DP rank); the
exchange costs one all-gather and one reduce-scatter (or gather and scatter) of the matrices,
and the result equals the single-process one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.data_parallel.ddp import all_gather, reduce_scatter
from megatron.mpu.utils import group_rank, group_size

MatrixFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (param, whole update) -> out


@dataclass
class Feed:
    """What an optimizer's builder sees of a backend's pieces (megatron.config.optimizers).

    `module`: the model's chunks (to find its matrices); `tp_group`: the TP group the
    TP-local weights are split over; `pairs`: (fp32 main, the model parameter it is a piece
    of); `exchange(selected, fn)`: this backend's way (Whole, Sharded, RowSharded) of running
    `fn` on the whole matrices of the parameters whose ids are in `selected`."""

    module: nn.Module
    tp_group: object
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    exchange: Callable

    def mains_of(self, selected) -> list[torch.Tensor]:
        """The mains that are pieces of the parameters whose ids are in `selected`."""
        return [main for main, p in self.pairs if id(p) in selected]

    def whole(self, selected, fn: MatrixFn):
        """(mains, updates) -> results, `fn` run on each selected parameter's whole update."""
        return self.exchange(selected, fn)


def deal(sizes: list[int], ranks: int) -> list[int]:
    """The DP rank that computes each matrix: round-robin in decreasing size (ties in the given
    order, the buffer's, so every DP and TP rank deals alike)."""
    owners = [0] * len(sizes)
    for k, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        owners[i] = k % ranks
    return owners


class Whole:
    """The plain optimizer's: `param_of` id(main) -> the model parameter it is the master of."""

    def __init__(self, param_of: dict[int, torch.Tensor], fn: MatrixFn):
        self.param_of, self.fn = param_of, fn

    def __call__(self, mains: list[torch.Tensor], updates: list[torch.Tensor]):
        return [self.fn(self.param_of[id(m)], u) for m, u in zip(mains, updates, strict=True)]


class Sharded:
    """The distributed optimizer's (see the module doc). `pairs`: (main, piece) of this rank's
    shard; `selected`: the ids of the parameters taken whole."""

    def __init__(self, ddp, pairs, selected, fn: MatrixFn):
        self.ddp, self.fn = ddp, fn
        self.piece_of = {id(main): pc for main, pc in pairs}
        self.owned = []
        # MoE experts differ between EP ranks: dealt over the expert-DP group (the ranks
        # holding the same experts, over which their buckets are sharded), the rest over DP
        for experts, group in ((False, ddp.dp_group), (True, ddp.expert_group)):
            matrices = [
                (p, lo, hi)
                for p, lo, hi in ddp.param_ranges
                if id(p) in selected and getattr(p, "expert_parallel", False) == experts
            ]
            owners = deal([p.numel() for p, _, _ in matrices], group_size(group))
            mine = group_rank(group)
            self.owned += [m for m, owner in zip(matrices, owners, strict=True) if owner == mine]
        self.buckets = [b for b in ddp.buckets if any(id(p) in selected for p in b.params)]

    def __call__(self, mains: list[torch.Tensor], updates: list[torch.Tensor]):
        full = torch.zeros_like(self.ddp.grad_buffer, dtype=torch.float32)
        for main, u in zip(mains, updates, strict=True):
            pc = self.piece_of[id(main)]
            full[pc.buf_lo : pc.buf_hi] = u
        for group, whole, shard in self._shards(full):  # every rank's shard into every bucket
            all_gather(whole, shard, group=group)
        out = torch.zeros_like(full)
        for p, lo, hi in self.owned:
            out[lo:hi] = self.fn(p, full[lo:hi].view(p.shape)).reshape(-1)
        for group, whole, shard in self._shards(out):  # the sum of the buckets into each shard
            reduce_scatter(shard, whole, group=group)
        return [out[self.piece_of[id(m)].buf_lo : self.piece_of[id(m)].buf_hi] for m in mains]

    def _shards(self, buffer: torch.Tensor):
        """(bucket's group, the whole bucket, this rank's shard) of the selected buckets."""
        for bucket in self.buckets:
            if bucket.size > 1:
                lo, hi = bucket.shard(bucket.rank, bucket.size)
                yield bucket.group, buffer[bucket.start : bucket.end], buffer[lo:hi]


class RowSharded:
    """--use-torch-fsdp2's (see the module doc): `pairs` (main, piece) of this rank's row
    shards, `selected` the ids of the parameters taken whole, `dp` the group they are split
    over. One gather and one scatter of each matrix over DP, no matrix computed twice."""

    def __init__(self, pairs, selected, fn: MatrixFn, dp):
        self.fn, self.dp_group = fn, dp
        self.items = [(main, pc) for main, pc in pairs if id(pc.param) in selected]
        self.size, self.rank = group_size(dp), group_rank(dp)
        self.owners = deal([pc.param.numel() for _, pc in self.items], self.size)

    def __call__(self, mains: list[torch.Tensor], updates: list[torch.Tensor]):
        given = {id(m): u for m, u in zip(mains, updates, strict=True)}
        out = {}
        for (main, pc), owner in zip(self.items, self.owners, strict=True):
            out[id(main)] = self._one(given[id(main)], pc, owner)
        return [out[id(m)] for m in mains]

    def _one(self, update: torch.Tensor, pc, owner: int) -> torch.Tensor:
        shape = tuple(pc.param.shape)  # the TP-local matrix
        rows, width = shape[0], pc.param.numel() // max(shape[0], 1)
        chunk = -(-rows // self.size)
        mine = torch.zeros(chunk, width, device=update.device)
        mine[: (pc.hi - pc.lo) // width] = update.view(-1, width)  # (my rows, width), padded
        src = dist.get_global_rank(self.dp_group, owner) if self.dp_group is not None else 0
        parts = [torch.empty_like(mine) for _ in range(self.size)] if self.rank == owner else None
        if self.size > 1:
            dist.gather(mine, parts, dst=src, group=self.dp_group)
        else:
            parts = [mine]
        if self.rank == owner:
            whole = torch.cat(parts)[:rows].view(shape)
            o = self.fn(pc.param, whole)
            padded = torch.zeros(chunk * self.size, width, device=update.device)
            padded[:rows] = o.reshape(rows, width)
            parts = list(padded.chunk(self.size))
        if self.size > 1:
            dist.scatter(mine, parts, src=src, group=self.dp_group)
        else:
            mine = parts[0]
        return mine[: (pc.hi - pc.lo) // width].reshape(-1)

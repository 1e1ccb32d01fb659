"""Muon under --use-distributed-optimizer (ShardedMatrices) and --use-torch-fsdp2
(RowShardedMatrices): each DP rank orthogonalises a share of the matrices.

A DP rank holds its shard (flat ranges) of every gradient bucket, and Muon's momentum for the
same ranges: the momentum is elementwise, so it shards, saves and reshards like Adam's moments.
Newton-Schulz needs whole matrices, so one step runs, on every DP rank r:

    gather   U_t of r's ranges into a zero buffer laid out as the grad buffer, all-gathered
             bucket by bucket over DP: every rank then holds U_t of every parameter
    NS       the matrices r owns: whole logical matrices (megatron.training.muon, TP-gathered
             as on one process), dealt round-robin in decreasing size over the DP ranks
    scatter  s NS(U_t) of r's matrices into a second zero buffer, reduce-scattered (sum) bucket
             by bucket: r receives the update of its own ranges. Every element is non-zero on
             its owner only, so the sum adds zeros and is exact.

MoE experts (megatron.training.muon: each expert's matrices on their own) are dealt the same
way over the expert-DP group, the ranks that hold the same experts (EP = DP: each rank its own).

Each matrix is orthogonalised by one DP rank (and, TP-split, by every TP rank of that DP rank),
the exchange costs one all-gather and one reduce-scatter of the Muon buckets (the size of the
weights, as the distributed optimizer's own gradient and weight exchanges), and the update
equals the single-process one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.data_parallel.ddp import _all_gather, _reduce_scatter
from megatron.mpu.utils import group_rank, group_size
from megatron.training.muon import (
    MatrixLayout,
    MuonAdamW,
    MuonSettings,
    build_muon,
    matrix_layouts,
    muon_settings,
    orthogonalize,
)


def sharded_muon(groups: list[dict], cfg, ddp, pairs, tp_group) -> MuonAdamW:
    """The distributed optimizer's MuonAdamW over `groups` of this rank's (main, piece) `pairs`."""
    settings = muon_settings(cfg)
    layouts = matrix_layouts(ddp.module, settings)
    muon = [main for main, pc in pairs if id(pc.param) in layouts]
    return build_muon(groups, cfg, muon, ShardedMatrices(ddp, pairs, layouts, settings, tp_group))


def deal(sizes: list[int], ranks: int) -> list[int]:
    """The DP rank that orthogonalises each matrix: round-robin in decreasing size (ties in
    the given order, the buffer's, so every DP and TP rank deals alike)."""
    owners = [0] * len(sizes)
    for k, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        owners[i] = k % ranks
    return owners


class ShardedMatrices:
    """The distributed optimizer's orthogonalizer (see the module doc).

    `pairs`: (main, piece) of this rank's shard; `layouts`: id(param) -> MatrixLayout of the
    parameters Muon takes."""

    def __init__(self, ddp, pairs, layouts: dict[int, MatrixLayout], settings: MuonSettings, tp):
        self.ddp, self.layouts, self.settings, self.tp_group = ddp, layouts, settings, tp
        self.piece_of = {id(main): pc for main, pc in pairs}
        self.owned = []
        # MoE experts differ between EP ranks: dealt over the expert-DP group (the ranks
        # holding the same experts, over which their buckets are sharded), the rest over DP
        for experts, group in ((False, ddp.dp_group), (True, ddp.expert_group)):
            matrices = [
                (p, lo, hi)
                for p, lo, hi in ddp.param_ranges
                if id(p) in layouts and getattr(p, "expert_parallel", False) == experts
            ]
            owners = deal([p.numel() for p, _, _ in matrices], group_size(group))
            mine = group_rank(group)
            self.owned += [m for m, owner in zip(matrices, owners, strict=True) if owner == mine]
        self.buckets = [b for b in ddp.buckets if any(id(p) in layouts for p in b.params)]

    def __call__(self, mains: list[torch.Tensor], updates: list[torch.Tensor]):
        full = torch.zeros_like(self.ddp.grad_buffer, dtype=torch.float32)
        for main, u in zip(mains, updates, strict=True):
            pc = self.piece_of[id(main)]
            full[pc.buf_lo : pc.buf_hi] = u
        self._all_gather(full)
        out = torch.zeros_like(full)
        for p, lo, hi in self.owned:
            whole = full[lo:hi].view(p.shape)
            o = orthogonalize(whole, self.layouts[id(p)], self.settings, self.tp_group)
            out[lo:hi] = o.reshape(-1)
        self._reduce_scatter(out)
        return [out[self.piece_of[id(m)].buf_lo : self.piece_of[id(m)].buf_hi] for m in mains]

    def _shards(self, buffer: torch.Tensor):
        """(bucket's group, the whole bucket, this rank's shard) of the Muon buckets over DP."""
        for bucket in self.buckets:
            if bucket.size > 1:
                lo, hi = bucket.shard(bucket.rank, bucket.size)
                yield bucket.group, buffer[bucket.start : bucket.end], buffer[lo:hi]

    def _all_gather(self, buffer: torch.Tensor) -> None:
        """In place: every rank's shard into every rank's bucket."""
        for group, whole, shard in self._shards(buffer):
            _all_gather(whole, shard, group=group)

    def _reduce_scatter(self, buffer: torch.Tensor) -> None:
        """In place: the sum of the ranks' buckets into each rank's shard."""
        for group, whole, shard in self._shards(buffer):
            _reduce_scatter(shard, whole, group=group)


class RowShardedMatrices:
    """--use-torch-fsdp2's orthogonalizer: each parameter's rows are split over the DP x CP
    mesh (FSDP2's dim-0 shards, ceil(rows / n) per rank, the last ones shorter). Per matrix,
    in the same order on every rank: its row shards are gathered (padded to equal size) on
    the DP rank that owns it (dealt as above), which orthogonalises it whole (TP-gathered as on
    one process) and scatters each rank its rows back. One gather and one scatter of the
    matrix over DP, no matrix computed twice."""

    def __init__(self, pairs, layouts: dict[int, MatrixLayout], settings: MuonSettings, tp, dp):
        self.layouts, self.settings, self.tp_group, self.dp_group = layouts, settings, tp, dp
        self.items = [(main, pc) for main, pc in pairs if id(pc.param) in layouts]
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
            o = orthogonalize(whole, self.layouts[id(pc.param)], self.settings, self.tp_group)
            padded = torch.zeros(chunk * self.size, width, device=update.device)
            padded[:rows] = o.reshape(rows, width)
            parts = list(padded.chunk(self.size))
        if self.size > 1:
            dist.scatter(mine, parts, src=src, group=self.dp_group)
        else:
            mine = parts[0]
        return mine[: (pc.hi - pc.lo) // width].reshape(-1)


def row_sharded_muon(groups: list[dict], cfg, model, pairs, tp_group) -> MuonAdamW:
    """--use-torch-fsdp2's MuonAdamW over `groups` of this rank's (main, piece) `pairs`
    (`model`: the FullyShardedModel, whose dp_group its parameters' rows are sharded over)."""
    settings = muon_settings(cfg)
    layouts = matrix_layouts(model.module, settings)
    muon = [main for main, pc in pairs if id(pc.param) in layouts]
    rows = RowShardedMatrices(pairs, layouts, settings, tp_group, model.dp_group)
    return build_muon(groups, cfg, muon, rows)

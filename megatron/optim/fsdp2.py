"""The optimizer of --use-torch-fsdp2: AdamW / SGD / Muon on this rank's fp32 shards of the
weights (a whole-matrix optimizer: megatron.optim.matrices' RowSharded).

It is the distributed optimizer's step (megatron.optim.sharded) on other pieces. A piece is
one parameter's shard on this DP x CP rank: its rows [first, last) of the TP-local tensor
(megatron.data_parallel.fsdp2), that is the flat range [first x row, last x row), updated through a
flat view of the DTensor's local tensor. The fp32 shards are the master weights themselves
(FSDP2 casts them for compute), so nothing is copied back after the step and FSDP2
all-gathers them in the next forward.

One step on DP x CP rank r (megatron.optim.sharded):
    grad   reduce-scattered by FSDP2 during backward: shard r's DP-averaged fp32 gradient
    check  inf/NaN over shard r, MAX-all-reduced over every rank (all skip together)
    norm   squares of shard r (TP-replicated params on TP rank 0 only), summed over DP x CP
           and over TP x PP; clipping scales the shards
    update the torch optimizer on the shards in place

Checkpoints: the distributed optimizer's form ({name: range, moments, fp32 "main" of half
models}), one file per DP x CP rank, so FSDP2, the distributed optimizer and the plain one load
each other's at any DP / TP / PP (megatron.training.state.load_optimizer;
megatron.optim.shards).
"""

from __future__ import annotations

import torch

from megatron.config.schema_optimizer import OptimizerConfig
from megatron.data_parallel.fsdp2 import FullyShardedModel, local_rows, local_tensor
from megatron.mpu.parallel_state import ParallelState
from megatron.optim.matrices import RowSharded
from megatron.optim.optimizer import MegatronOptimizer
from megatron.optim.sharded import ShardPieces
from megatron.optim.shards import Piece


def fsdp_pieces(model: FullyShardedModel) -> list[Piece]:
    """This rank's shard of every parameter, as the flat range it covers."""
    pieces = []
    for p in model.params:
        first, last = local_rows(p)
        row = p.numel() // p.shape[0] if p.shape[0] else 0
        pieces.append(Piece(model.names[id(p)], p, first * row, last * row, 0, 0))
    return pieces


class RowShards:
    """Where FSDP2's pieces live (megatron.optim.sharded's place): the fp32 shards themselves,
    flat views of each DTensor's local tensor, the masters updated in place."""

    def __init__(self, model: FullyShardedModel):
        self.model = model
        self.device = model.params[0].device if model.params else torch.device("cpu")
        self.pieces = fsdp_pieces(model)
        self.mains = [self.weights(pc) for pc in self.pieces]

    def weights(self, piece: Piece) -> torch.Tensor:
        """The weights of a piece are its master: the shard itself."""
        return local_tensor(piece.param).view(-1)

    def grads(self) -> list[torch.Tensor]:
        return [pc.param.main_grad.view(-1) for pc in self.pieces]

    def exchange(self, pairs, selected, fn):
        return RowSharded(pairs, selected, fn, self.model.dp_group)

    def after_update(self, masters: bool) -> None:
        """Nothing to copy: the shards were updated in place; FSDP2 gathers them when used."""

    def reload(self, masters: bool) -> None:
        """The loaded weights are the masters already."""


def fsdp2_optimizer(
    model: FullyShardedModel,
    cfg: OptimizerConfig,
    *,
    params_dtype: torch.dtype,
    state: ParallelState,
    clip_grad: float,
) -> MegatronOptimizer:
    """--use-torch-fsdp2: the optimizer over this rank's fp32 shards."""
    half = params_dtype in (torch.float16, torch.bfloat16)
    pieces = ShardPieces(RowShards(model), state, half)
    return MegatronOptimizer(pieces, cfg, params_dtype=params_dtype, clip_grad=clip_grad)

"""The optimizer of --use-torch-fsdp2: AdamW / SGD / Muon on this rank's fp32 shards of the
weights (Muon: megatron.training.muon_sharded's RowShardedMatrices).

It is the distributed optimizer's step on other pieces. A piece is one parameter's shard on
this DP x CP rank: its rows [first, last) of the TP-local tensor (megatron.data_parallel.fsdp2),
that is the flat range [first x row, last x row), updated through a flat view of the
DTensor's local tensor. The fp32 shards are the master weights themselves (FSDP2 casts them
for compute), so nothing is copied back after the step and FSDP2 all-gathers them in the next
forward.

One step on DP x CP rank r (megatron.training.distrib_optimizer._step):
    grad   reduce-scattered by FSDP2 during backward: shard r's DP-averaged fp32 gradient
    check  inf/NaN over shard r, MAX-all-reduced over every rank (all skip together)
    norm   squares of shard r (TP-replicated params on TP rank 0 only), summed over DP x CP
           and over TP x PP; clipping scales the shards
    update AdamW / SGD on the shards in place

Checkpoints: the distributed optimizer's form ({name: range, moments, fp32 "main" of half
models}), one file per DP x CP rank, so FSDP2, the distributed optimizer and the plain one load
each other's at any DP / TP / PP (megatron.training.state.load_optimizer).
"""

from __future__ import annotations

import torch

from megatron.config.schema import OptimizerConfig
from megatron.data_parallel.fsdp2 import FullyShardedModel, local_rows, local_tensor
from megatron.mpu import ParallelState
from megatron.training.distrib_optimizer import (
    DistributedOptimizer,
    _Piece,
    optimizer_over_pieces,
)
from megatron.training.muon_sharded import row_sharded_muon
from megatron.training.optimizer import make_grad_scaler


def fsdp_pieces(model: FullyShardedModel) -> list[_Piece]:
    """This rank's shard of every parameter, as the flat range it covers."""
    pieces = []
    for p in model.params:
        first, last = local_rows(p)
        row = p.numel() // p.shape[0] if p.shape[0] else 0
        pieces.append(_Piece(model.names[id(p)], p, first * row, last * row, 0, 0))
    return pieces


class FSDPOptimizer(DistributedOptimizer):
    """step() -> (updated?, grad norm or None), as MegatronOptimizer, on this rank's shards."""

    overlap_param_gather = False

    def __init__(
        self,
        model: FullyShardedModel,
        cfg: OptimizerConfig,
        *,
        params_dtype: torch.dtype,
        state: ParallelState,
        clip_grad: float,
    ):
        self.state, self.clip_grad, self.ddp = state, clip_grad, model
        self.device = model.params[0].device if model.params else torch.device("cpu")
        self.half = params_dtype in (torch.float16, torch.bfloat16)
        self.pieces = fsdp_pieces(model)
        # flat views of the shards: the distributed optimizer's flat ranges, updated in place
        self.mains = [local_tensor(pc.param).view(-1) for pc in self.pieces]
        self.optimizer = optimizer_over_pieces(
            self.mains, self.pieces, model, cfg, state, row_sharded_muon
        )
        self.scaler = make_grad_scaler(cfg, params_dtype)

    def _weights(self, piece: _Piece) -> torch.Tensor:
        """The weights of a piece are its master: the shard itself."""
        return local_tensor(piece.param).view(-1)

    def _grads(self) -> list[torch.Tensor]:
        return [pc.param.main_grad.view(-1) for pc in self.pieces]

    def _after_update(self) -> None:
        """Nothing to copy: the shards were updated in place; FSDP2 gathers them when used."""

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """The loaded weights are the masters already."""

"""--use-distributed-optimizer: fp32 main weights and optimizer moments sharded over DP.

With the plain optimizer every DP rank holds, per parameter, the fp32 main weight (4 bytes,
half models only) and Adam's two moments (8 bytes): 16 bytes/param for fp32 models (param 4 +
grad 4 + moments 8), 18 for bf16/fp16 (param 2 + grad 4 + main 4 + moments 8). Here each DP
rank keeps them only for its shard of every gradient bucket (megatron.data_parallel.ddp: a bucket
padded to a multiple of DP and cut into DP contiguous shards), so per parameter it holds
4 + 4 + 8 / DP (fp32) or 2 + 4 + 12 / DP (half) bytes.

One step, on every DP rank r (megatron.optim.optimizer's tail, megatron.optim.sharded's norm):
    grad   buckets reduce-scattered during backward (DDP): shard r holds the DP-averaged grad
    check  inf/NaN over shard r, MAX-all-reduced over all ranks (every rank skips together)
    norm   ||g||^2 = sum over ranks of the shard sums (TP-replicated params on TP rank 0 only,
           the tied embedding's last-stage copy never), summed over DP, then over TP x PP
    update the torch optimizer on shard r's fp32 mains; copied into the param buffer (half)
    gather param buckets all-gathered in place (--overlap-param-gather: the next forward waits
           per module, so the all-gather overlaps with the forward)

Checkpoints (megatron.training.state): the shard of each DP rank is saved by that rank in the
form of megatron.optim.shards, which any DP size, the plain optimizer and FSDP2 read.
"""

from __future__ import annotations

import torch

from megatron.config.schema_optimizer import OptimizerConfig
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.mpu.parallel_state import ParallelState
from megatron.optim.matrices import Sharded
from megatron.optim.optimizer import MegatronOptimizer
from megatron.optim.sharded import ShardPieces
from megatron.optim.shards import Piece, parameter_names


def shard_pieces(ddp: DistributedDataParallel) -> list[Piece]:
    """The pieces of parameters in this DP rank's shard of every bucket, in buffer order."""
    names = parameter_names(ddp.module)
    bucket_shards = [b.shard(b.rank, b.size) for b in ddp.buckets]
    pieces = []
    for p, start, end in ddp.param_ranges:
        for s_lo, s_hi in bucket_shards:
            lo, hi = max(start, s_lo), min(end, s_hi)
            if lo < hi:
                pieces.append(Piece(names[id(p)], p, lo - start, hi - start, lo, hi))
    return pieces


class Buckets:
    """Where the distributed optimizer's pieces live: this DP rank's shard of every bucket of
    our DDP (megatron.optim.sharded's place). fp32 models: the mains are views of the param
    buffer (updated in place); half models: fp32 copies, copied back after the step."""

    def __init__(self, ddp: DistributedDataParallel, half: bool, overlap_param_gather: bool):
        if not getattr(ddp, "distributed", False):
            raise ValueError(
                "DistributedOptimizer needs DistributedDataParallel built with "
                "use_distributed_optimizer=True (sharded, padded buckets)"
            )
        self.model, self.overlap_param_gather = ddp, overlap_param_gather
        self.device = ddp.grad_buffer.device
        self.pieces = shard_pieces(ddp)
        views = [self.weights(pc) for pc in self.pieces]
        self.mains = [v.detach().clone().float() for v in views] if half else views

    def weights(self, piece: Piece) -> torch.Tensor:
        """The model's weights of `piece` (flat): its elements of the param buffer."""
        return self.model.param_buffer[piece.buf_lo : piece.buf_hi]

    def grads(self) -> list[torch.Tensor]:
        return [self.model.grad_buffer[pc.buf_lo : pc.buf_hi] for pc in self.pieces]

    def exchange(self, pairs, selected, fn):
        return Sharded(self.model, pairs, selected, fn)

    def after_update(self, masters: bool) -> None:
        """The updated shard into the param buffer (half models), then all-gathered over DP."""
        if masters and self.pieces:  # one fused copy of every piece
            views = [self.weights(pc) for pc in self.pieces]
            torch._foreach_copy_(views, self.mains)
        self.model.start_param_sync(overlap=self.overlap_param_gather)

    def reload(self, masters: bool) -> None:
        self.model.finish_param_sync()
        if masters:
            for pc, main in zip(self.pieces, self.mains, strict=True):
                main.copy_(self.weights(pc))


def distributed_optimizer(
    ddp: DistributedDataParallel,
    cfg: OptimizerConfig,
    *,
    params_dtype: torch.dtype,
    state: ParallelState,
    clip_grad: float,
    overlap_param_gather: bool = False,
) -> MegatronOptimizer:
    """--use-distributed-optimizer: the optimizer over this DP rank's shard of the buckets."""
    half = params_dtype in (torch.float16, torch.bfloat16)
    pieces = ShardPieces(Buckets(ddp, half, overlap_param_gather), state, half)
    return MegatronOptimizer(pieces, cfg, params_dtype=params_dtype, clip_grad=clip_grad)

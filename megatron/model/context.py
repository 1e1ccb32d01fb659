"""BuildContext: everything a model needs besides its architecture to build this rank's part.

A model is built from (ModelConfig, BuildContext) alone: the config says what the network is
(and is what checkpoints record), the context says where this rank builds it (its place in the
TP x PP x DP grid, device, dtype), which seed draws the weights, which RNG streams dropout uses
and which kernels compute it. Recompute, torch.compile and sequence-parallel marking are not
here: they are applied to the built model by megatron.model.parallelize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.fused_kernels import TORCH_OPS, FusedOps
from megatron.mpu.parallel_state import ParallelState, single_process_state
from megatron.mpu.random import RNGStatesTracker


@dataclass(frozen=True)
class BuildContext:
    """This rank's build settings. The default is one process on the default device, fp32,
    plain torch ops, seed 1234 (what tests and conversion tools build)."""

    state: ParallelState = field(default_factory=single_process_state)
    seed: int = 1234  # weights are drawn from (seed, parameter name) on their full shapes
    device: torch.device | str | None = None
    dtype: torch.dtype = torch.float32
    rng_tracker: RNGStatesTracker | None = None  # TP-rank dropout streams (None: default RNG)
    ops: FusedOps = TORCH_OPS  # kernel choices (megatron.fused_kernels.select_ops)
    moe_dispatcher: str = "alltoall"  # --moe-token-dispatcher-type (expert parallelism)
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm: experts as one grouped matmul

    def __post_init__(self):
        if self.ops is None:  # "no kernel choice": plain torch
            object.__setattr__(self, "ops", TORCH_OPS)


def start_chunk(model, cfg, ctx: BuildContext | None, pre_process: bool, post_process: bool):
    """What a family's model chunk sets first: its config, the context's process groups, RNG
    tracker and kernels, which ends of the pipeline it holds, and the recompute slot
    megatron.model.parallelize fills (a LayerRecompute). Returns the context."""
    ctx = ctx or BuildContext()
    model.cfg, model.state, model.rng_tracker, model.ops = cfg, ctx.state, ctx.rng_tracker, ctx.ops
    model.layer_recompute = None
    model.pre_process, model.post_process = pre_process, post_process
    return ctx


def chunk_embedding(make, cfg, ctx: BuildContext, pre_process: bool, needed: bool):
    """The chunk's embedding (`make(cfg, ctx, word_only=...)`), or None where not `needed`: the
    whole one on the first stage, the word table alone on a later stage that reads it (a tied
    head, MTP), marked shared there so that norms count it once."""
    if not needed:
        return None
    embedding = make(cfg, ctx, word_only=not pre_process)
    if not pre_process:
        embedding.word_embeddings.weight.shared = True
    return embedding

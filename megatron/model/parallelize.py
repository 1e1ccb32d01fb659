"""Apply the run-time transformations to a built model, by name, in a fixed order.

A model family builds its network from (ModelConfig, BuildContext) only; what changes how it
computes but never its weights is applied here afterwards, always in this order:

1. sequence parallel: mark the replicated parameters that see only this TP rank's s / p tokens
   (their gradients are summed over TP before the optimizer steps);
2. activation recompute: selective (the core attention of each `*.self_attention`) or full
   (the transformer layers of each chunk, uniform groups or the first N);
3. float8 (--fp8-format): the transformer layers' linears get float8 GEMMs (megatron.model.fp8);
4. torch.compile: each model chunk compiled as one module (nn.Module.compile: its parameter
   names, hence checkpoints, are unchanged), so one graph holds the embedding, every
   transformer layer, the head and the vocab-parallel loss; with `cuda_graph` Inductor replays
   it as CUDA graphs (mode "reduce-overhead", CUDA graph trees).

Compile comes last so it traces the recompute and the float8 casts the layers will run (as
torchtitan applies TP, float8, activation checkpointing, then compile).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megatron.config.schema import PrecisionConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.model.attention.core import CoreAttention
from megatron.model.fp8 import apply_fp8
from megatron.model.moe import MoELayer
from megatron.model.norms import NORM_TYPES
from megatron.model.recompute import LayerRecompute
from megatron.model.stages import ModelChunks
from megatron.mpu.layers import mark_sequence_parallel
from megatron.mpu.parallel_state import ParallelState

POSITION_TABLE = "position_embeddings.weight"


def parallelize(
    model: nn.Module,
    state: ParallelState,
    recompute: RecomputeConfig | None = None,
    *,
    torch_compile: bool = False,
    compile_backend: str = "inductor",
    cuda_graph: bool = False,
    checkpoint_impl: Callable | None = None,
    precision: PrecisionConfig | None = None,
) -> nn.Module:
    """`model`: ModelChunks or one chunk (or a piece of one: a DeepSpeed pipeline layer).
    Returns it, transformed in place. `precision`: its --fp8-format, if any, is applied (and
    logged on rank 0). `cuda_graph` replays what `torch_compile` compiled; the flags that
    cannot take it are refused by megatron.config.rules_compute, the device is checked here."""
    apply_sequence_parallel(model, state)
    if recompute is not None:
        apply_recompute(model, recompute, checkpoint_impl)
    report = apply_fp8(model, precision) if precision is not None else None
    if report is not None and state.rank == 0:
        print(report.describe(), flush=True)
    if torch_compile:
        apply_compile(model, compile_backend, cuda_graph)
    return model


def apply_sequence_parallel(model: nn.Module, state: ParallelState) -> None:
    """--sequence-parallel: mark norm weights and biases, the learned position table and the
    MoE routers, experts (when replicated over TP, ETP = 1) and shared-expert gates (the
    row-parallel biases mark themselves when built with the sequence-parallel layout)."""
    if not state.sequence_parallel:
        return
    for module in model.modules():
        if isinstance(module, NORM_TYPES):
            for param in module.parameters(recurse=False):
                mark_sequence_parallel(param)
        if isinstance(module, MoELayer):  # replicated over TP, routing this rank's tokens
            # experts split over ETP compute every token of the TP group: whole gradients
            experts = module.experts if state.etp_size == 1 else None
            for part in (module.router, experts, module.shared_expert_gate):
                for param in part.parameters() if part is not None else ():
                    mark_sequence_parallel(param)
    for name, param in model.named_parameters():
        if name == POSITION_TABLE or name.endswith("." + POSITION_TABLE):
            mark_sequence_parallel(param)


def apply_recompute(model: nn.Module, recompute: RecomputeConfig, impl=None) -> None:
    """selective: recompute each attention layer's softmax(q k^T) v in backward; full: the
    chunks (modules with a `layer_recompute` slot) recompute their transformer layers."""
    if recompute.granularity == "selective":
        for _, module in model.named_modules():
            if isinstance(module, CoreAttention):  # every attention variant's core
                module.recompute = True
    elif recompute.granularity == "full":
        policy = LayerRecompute(recompute.method, recompute.num_layers, impl)
        for _, module in model.named_modules():
            if hasattr(module, "layer_recompute"):
                module.layer_recompute = policy


def apply_compile(model: nn.Module, backend: str = "inductor", cuda_graph: bool = False) -> None:
    """Compile each model chunk as a module (nn.Module.compile): the chunk's call runs compiled,
    its parameters keep their names. `cuda_graph`: Inductor's CUDA graph trees replay the
    compiled forward and backward (a CUDA device and the inductor backend)."""
    if cuda_graph:
        _check_cuda_graph_device(model)
    chunks = model.chunks if isinstance(model, ModelChunks) else [model]
    for chunk in chunks:
        if cuda_graph:
            chunk.compile(backend=backend, mode="reduce-overhead")
        else:
            chunk.compile(backend=backend)


def _check_cuda_graph_device(model: nn.Module) -> None:
    """What only the run time shows (the flags are megatron.config.rules_compute's)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(
            f"--enable-cuda-graph needs a CUDA device; this model is on {device}. Fix: drop "
            "--enable-cuda-graph (--torch-compile alone runs on any device)"
        )

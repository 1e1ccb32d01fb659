"""Model-parallel utilities. Imports nothing from the rest of `megatron`."""

from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.grads import (
    all_reduce_sequence_parallel_grads,
    clip_grad_norm,
    grad_norm,
    reduce_sequence_parallel_grads_in_backward,
)
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_full_into_param,
    gathered_linear,
    init_normal,
    is_sequence_parallel,
    is_tensor_parallel,
    mark_sequence_parallel,
    partition_of,
)
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sequence_slice,
)
from megatron.mpu.parallel_state import (
    ParallelState,
    destroy_model_parallel,
    initialize_model_parallel,
    single_process_state,
)
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint
from megatron.mpu.utils import shard, unshard

__all__ = [
    "gathered_linear",
    "sequence_slice",
    "scatter_to_sequence_parallel_region",
    "reduce_sequence_parallel_grads_in_backward",
    "reduce_scatter_to_sequence_parallel_region",
    "mark_sequence_parallel",
    "is_sequence_parallel",
    "gather_from_sequence_parallel_region",
    "all_reduce_sequence_parallel_grads",
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "ParallelState",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "clip_grad_norm",
    "copy_full_into_param",
    "copy_to_tensor_model_parallel_region",
    "destroy_model_parallel",
    "gather_from_tensor_model_parallel_region",
    "grad_norm",
    "init_normal",
    "initialize_model_parallel",
    "is_tensor_parallel",
    "partition_of",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "shard",
    "single_process_state",
    "unshard",
    "vocab_parallel_cross_entropy",
]

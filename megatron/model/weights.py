"""Per-name seeded initialization, shared by every model family.

Every weight is drawn from a generator seeded by (seed, name) on its full, unsharded shape
before being sliced, so one seed gives one model at any TP size; names are global (`layers.7...`
wherever layer 7 lives), so any PP layout draws the same weights too.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from megatron.config.schema import ModelConfig
from megatron.model.norms import NORM_TYPES
from megatron.mpu.expert_shards import cut_whole, whole_shape
from megatron.mpu.layers import copy_full_into_param
from megatron.mpu.parallel_state import ParallelState

# Output projections of residual branches get std / sqrt(2 x num_layers) (GPT-2's scaled init).
_SCALED_INIT_SUFFIXES = (
    "self_attention.dense.weight",
    "mlp.dense_4h_to_h.weight",
    "mlp.experts.weight2",
    "mlp.shared_expert.dense_4h_to_h.weight",
)
# The vocab-sized weights: their rows past the real vocab are padding (see padded_vocab_size).
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_WEIGHTS = "head.output_layer.weight"


def _generator(seed: int, name: str) -> torch.Generator:
    # crc32 is stable across processes and Python versions (hash() is salted).
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _full_shape(param: torch.Tensor, state: ParallelState) -> list[int]:
    if getattr(param, "expert_parallel", False):  # MoE experts: split over EP and ETP
        return whole_shape(param, state)
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= state.tp_size
    return shape


@torch.no_grad()
def init_weights(
    model: nn.Module, cfg: ModelConfig, state: ParallelState, seed: int, prefix: str = ""
) -> None:
    """Initialize every parameter from (seed, name) on its full shape, then keep this rank's slice.

    `prefix` names a piece built on its own (a DeepSpeed pipeline layer) as it is named inside
    GPTModel, so it draws exactly the same weights.

    Norm weights 1, biases 0, other weights N(0, std) with std / sqrt(2 L) for the output
    projections of residual branches. Vocab-sized weights draw only the real vocab rows, with
    zero padding rows, so the draw does not depend on how far the vocab was padded.
    """
    norm_params = {
        f"{mname}.{pname}"
        for mname, m in model.named_modules()
        if isinstance(m, NORM_TYPES)
        for pname, _ in m.named_parameters(recurse=False)
    }
    scaled_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    for local_name, param in model.named_parameters():
        name = prefix + local_name
        full = torch.empty(_full_shape(param, state), dtype=torch.float32)
        if local_name in norm_params:
            full.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith(("bias", "experts.bias1", "experts.bias2")):  # MoE experts' too
            full.zero_()
        else:
            std = scaled_std if name.endswith(_SCALED_INIT_SUFFIXES) else cfg.init_method_std
            rows = cfg.vocab_size if name in (WORD_EMBEDDINGS, OUTPUT_WEIGHTS) else full.shape[0]
            full.zero_()
            full[:rows].normal_(0.0, std, generator=_generator(seed, name))
        if getattr(param, "expert_parallel", False):  # this EP rank's experts, ETP shard
            param.copy_(cut_whole(full, param, state))
        else:
            copy_full_into_param(param, full, state.tp_group)

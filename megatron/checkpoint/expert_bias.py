"""--moe-router-enable-expert-bias turned on or off between a checkpoint and the run loading it.

The routers' `expert_bias` buffers (megatron.model.router) are the only tensors a load lets
differ from the model's. A checkpoint saved without them loads into a model with them: each
bias starts at zero, as Megatron-core initialises it, and balancing trains on from there. A
checkpoint saved with them loads into a model without them: the biases are dropped, as
Megatron-core's default load ignores checkpoint tensors the model does not ask for. Every
other missing or unexpected tensor still fails the load. The caller logs the one line
(megatron.training.checkpoint_args.expert_bias_note).
"""

from __future__ import annotations

import torch

SUFFIX = "router.expert_bias"


def is_expert_bias(name: str) -> bool:
    return name == SUFFIX or name.endswith("." + SUFFIX)


def zero_bias(shape) -> torch.Tensor:
    """A bias the checkpoint does not hold: zeros in fp32 (the router keeps it fp32)."""
    return torch.zeros(shape, dtype=torch.float32)


def fit_expert_biases(saved: dict, wanted: dict) -> dict:
    """`saved` (a model state dict read from a checkpoint) in the order and names of `wanted`
    (the model's) when the two differ by expert biases only: a bias missing from `saved`
    is zero, one `wanted` lacks is dropped. Otherwise `saved` itself, for the usual checks."""
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k not in wanted]
    if not missing and not extra:
        return saved
    if not all(map(is_expert_bias, missing + extra)):
        return saved
    return {k: saved[k] if k in saved else zero_bias(wanted[k].shape) for k in wanted}

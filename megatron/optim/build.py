"""The torch optimizer of --optimizer, built by name from megatron.config.optimizers, and what
every backend asks of it: the weight-decay groups, whether it skips on a device flag, and
whether a loaded state is its own."""

from __future__ import annotations

import torch
from torch import nn

from megatron.config.optimizers import get_kind
from megatron.config.schema_optimizer import OptimizerConfig


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (all 1-D) get wd_mult 0."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 else decay).append(p)
    return [
        g
        for g in ({"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0})
        if g["params"]
    ]


def build_torch_optimizer(groups: list[dict], cfg: OptimizerConfig, feed=None):
    """The torch optimizer of `cfg.optimizer` over `groups` (each with its wd_mult); `feed`:
    the backend's megatron.optim.matrices.Feed of its pieces (what a whole-matrix optimizer
    needs; None where the backend has none, DeepSpeed's)."""
    kind = get_kind(cfg.optimizer)
    if kind.whole_matrices and feed is None:
        raise ValueError(f"--optimizer {kind.name} needs whole matrices: build it in a backend")
    return kind.builder()(groups, cfg, feed)


def check_state_kind(optimizer: torch.optim.Optimizer, kind: str, states=None) -> None:
    """A loaded state must be this optimizer's (megatron.config.optimizers' state keys): Adam's
    moments where AdamW steps, a momentum buffer where SGD or Muon does (a resume with another
    --optimizer would fail in torch, or silently start a moment from zero). `states`: (param,
    state) pairs, default the optimizer's own."""
    entry = get_kind(kind)
    matrices = getattr(optimizer, "matrix_ids", set())  # a whole-matrix optimizer's
    for p, state in optimizer.state.items() if states is None else states:
        keys = entry.matrix_state_keys if id(p) in matrices else entry.state_keys
        want = keys[0] if keys else None
        if state and want is not None and want not in state:
            raise ValueError(
                f"the checkpoint's optimizer state holds {sorted(state)}, not the {want} that "
                f"--optimizer {kind} keeps: it was saved by another --optimizer. Fix: resume "
                "with the --optimizer it was saved with, or pass --no-load-optim"
            )


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer skips its update on a device flag (`optimizer.found_inf`, 0-d, 1.0 =
    skip): torch's fused AdamW. Not fused SGD: a first step skipped that way leaves its momentum
    buffer uninitialized (torch 2.13 on the CPU)."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))

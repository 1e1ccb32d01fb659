"""The element-by-element optimizers of the table: AdamW and SGD with momentum (torch's)."""

from __future__ import annotations

import torch

from megatron.config.schema_optimizer import OptimizerConfig


def set_weight_decay(groups: list[dict], cfg: OptimizerConfig) -> list[dict]:
    """Each group's weight decay from its `wd_mult` (0 for biases and norms)."""
    for g in groups:
        g["weight_decay"] = cfg.weight_decay * g["wd_mult"]
    return groups


def sgd(groups: list[dict], cfg: OptimizerConfig, feed=None) -> torch.optim.Optimizer:
    return torch.optim.SGD(set_weight_decay(groups, cfg), lr=cfg.lr, momentum=cfg.sgd_momentum)


def adamw(groups: list[dict], cfg: OptimizerConfig, feed=None) -> torch.optim.Optimizer:
    """apex's FusedAdam where installed and every weight is on CUDA, else torch's fused AdamW
    (CUDA, and CPU since torch 2.4: one pass, takes found_inf), else its foreach AdamW."""
    groups = set_weight_decay(groups, cfg)
    kw = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, only if the user installed it

        if all(p.is_cuda for g in groups for p in g["params"]):
            return FusedAdam(groups, adam_w_mode=True, **kw)
    except ImportError:
        pass
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kw)

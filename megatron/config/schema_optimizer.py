"""The optimizer section of the config tree (`optimizer.*`): the optimizer, its learning-rate
schedule, loss scaling, clipping. Part of megatron.config.schema (import them from here);
declared the same way, with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting
from megatron.config.optimizers import NAMES as OPTIMIZER_NAMES

LR_DECAY_STYLES = ("constant", "linear", "cosine", "exponential", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


_MUON = ("optimizer", "muon")  # the Muon settings mean something to --optimizer muon only


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """Optimizer, learning-rate schedule and fp16 loss scaling (Megatron's flag names)."""

    optimizer: str = setting(
        "adam",
        "adam = AdamW (decoupled weight decay), sgd with momentum, or muon (the transformer "
        "layers' matrices take Muon, embeddings, output head, norms and biases AdamW with "
        "--lr and the --adam-* flags; docs/configuration.md)",
        choices=OPTIMIZER_NAMES,
    )
    lr: float | None = setting(None, "peak learning rate (required)", above=0)
    min_lr: float = setting(0.0, "floor of the decay", min=0)
    weight_decay: float = setting(0.01, "decoupled weight decay; never applied to biases and norms")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    adam_eps: float = setting(1e-8, "Adam epsilon")
    sgd_momentum: float = setting(0.9, "SGD momentum")
    muon_momentum: float = setting(
        0.95,
        "Muon: momentum (EMA of the gradients that Newton-Schulz orthogonalises)",
        min=0,
        below=1,
        requires=_MUON,
    )
    muon_nesterov: bool = setting(
        True,
        "Muon: Nesterov momentum (orthogonalise (1 - mu) g + mu B instead of B)",
        shortcuts={
            "--muon-nesterov": (True, "Megatron-core's spelling: Nesterov on (the default)"),
            "--muon-use-nesterov": (True, "older Megatron / MindSpeed spelling of --muon-nesterov"),
        },
        requires=_MUON,
    )
    muon_num_ns_steps: int = setting(
        5,
        "Muon: quintic Newton-Schulz iterations per update",
        "--muon-ns-steps",
        min=1,
        max=99,
        requires=_MUON,
    )
    muon_scale_mode: str = setting(
        "spectral",
        "Muon: update scale by the matrix's A x B shape: spectral sqrt(max(A, B)), "
        "unit_rms_norm sqrt(A / B), shape_scaling sqrt(max(1, A / B)); times "
        "--muon-extra-scale-factor",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
        requires=_MUON,
    )
    muon_extra_scale_factor: float = setting(
        0.2,
        "Muon: multiplies the update scale; 0.2 with spectral is Moonlight's rule, which gives "
        "Muon's update AdamW's RMS so one --lr serves both (Megatron-core's default is 1.0)",
        above=0,
        requires=_MUON,
    )
    muon_split_qkv: bool = setting(
        True,
        "Muon: orthogonalise Q, K and V of the fused query_key_value weight (and, beyond "
        "Megatron-core's flag, SwiGLU's gate and up) as separate matrices",
        flag="--muon-no-split-qkv",
        requires=_MUON,
    )
    lr_decay_style: str = setting(
        "linear",
        "decay after warmup (exponential: Megatron-LM v1.x's, halving over the decay)",
        choices=LR_DECAY_STYLES,
    )
    lr_decay_iters: int | None = setting(
        None, "iterations to decay over (default --train-iters)", min=1
    )
    lr_decay_samples: int | None = setting(
        None, "samples to decay over (default --train-samples)", min=1
    )
    lr_warmup_init: float = setting(
        0.0,
        "lr of the first update when warming up (Megatron-LM's flag; the warmup runs linearly "
        "from it to --lr, and the first update uses it: 0 by default, as in Megatron-LM)",
        min=0,
    )
    lr_warmup_iters: int = setting(0, "linear warmup iterations", min=0)
    lr_warmup_samples: int = setting(0, "linear warmup samples", min=0)
    lr_warmup_fraction: float | None = setting(
        None, "warmup as a fraction of the decay length", min=0, below=1
    )
    warmup: float | None = setting(None, "classic spelling of --lr-warmup-fraction", min=0, below=1)
    lr_wsd_decay_style: str = setting(
        "exponential",
        "WSD: shape of the final annealing phase",
        choices=LR_WSD_DECAY_STYLES,
    )
    lr_wsd_decay_iters: int | None = setting(None, "WSD: iterations of the final annealing phase")
    lr_wsd_decay_samples: int | None = setting(None, "WSD: samples of the final annealing phase")
    override_lr_scheduler: bool = setting(
        False, "on resume, use these flags' schedule (keep only the step count)"
    )
    use_checkpoint_lr_scheduler: bool = setting(False, "on resume, use the checkpoint's schedule")
    loss_scale: float | None = setting(None, "fp16: static loss scale (default: dynamic)", above=0)
    initial_loss_scale: float = setting(2.0**32, "fp16: first dynamic scale")
    min_loss_scale: float = setting(
        1.0, "fp16: the dynamic scale never goes below this", "--min-scale", above=0
    )
    loss_scale_window: int = setting(
        1000, "fp16: steps without overflow before the scale doubles", min=1
    )
    hysteresis: int = setting(2, "fp16: overflows tolerated before the scale is halved", min=1)
    use_distributed_optimizer: bool = setting(
        False,
        "shard the fp32 main weights and optimizer moments over the data-parallel ranks "
        "(ZeRO-1): gradients are reduce-scattered, each rank updates its shard, the weights "
        "are all-gathered",
    )
    overlap_param_gather: bool = setting(
        False,
        "with --use-distributed-optimizer: all-gather the updated weights bucket by bucket "
        "during the next forward instead of right after the step",
    )

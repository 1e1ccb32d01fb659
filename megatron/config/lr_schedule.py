"""What the learning-rate schedule flags mean in scheduler steps.

--train-iters: a step is an iteration (step() adds 1); the decay runs over --lr-decay-iters
(default --train-iters) and the warmup over --lr-warmup-iters. --train-samples: a step is a
sample (step() adds the global batch); the decay runs over --lr-decay-samples (default
--train-samples) and the warmup over --lr-warmup-samples. --lr-warmup-fraction (or its classic
spelling --warmup) gives the warmup as round(fraction x decay steps) in either mode.

This mapping lives beside the rules because both need it: `megatron.config.rules` checks the
resulting lengths against each other (naming the flags), and the trainer hands them to
AnnealingLR (megatron/training/learning_rates.py). Nothing here re-checks the flags.
"""

from __future__ import annotations

from megatron.config.schema_optimizer import OptimizerConfig
from megatron.config.schema_training import TrainingConfig

__all__ = ["schedule_steps", "scheduler_steps"]


def scheduler_steps(
    *,
    train_iters: int | None = None,
    train_samples: int | None = None,
    global_batch_size: int | None = None,
    lr_decay_iters: int | None = None,
    lr_decay_samples: int | None = None,
    lr_warmup_iters: int = 0,
    lr_warmup_samples: int = 0,
    lr_warmup_fraction: float | None = None,
    warmup: float | None = None,
    lr_wsd_decay_iters: int | None = None,
    lr_wsd_decay_samples: int | None = None,
) -> dict[str, int | None]:
    """The schedule flags -> AnnealingLR's warmup_steps, decay_steps, wsd_decay_steps and the
    step() increment. Flags of the other mode are ignored (validate_training refuses them)."""
    if (train_iters is None) == (train_samples is None):
        raise ValueError("scheduler_steps needs exactly one of train_iters and train_samples")
    if train_iters is not None:
        train, decay, warm, wsd, increment = (
            train_iters,
            lr_decay_iters,
            lr_warmup_iters,
            lr_wsd_decay_iters,
            1,
        )
    else:
        if not global_batch_size or global_batch_size < 1:
            raise ValueError(
                f"sample-based steps need global_batch_size >= 1, not {global_batch_size}"
            )
        train, decay, warm, wsd, increment = (
            train_samples,
            lr_decay_samples,
            lr_warmup_samples,
            lr_wsd_decay_samples,
            global_batch_size,
        )
    decay = train if decay is None else decay
    fraction = warmup if lr_warmup_fraction is None else lr_warmup_fraction
    if fraction is not None:
        warm = round(fraction * decay)
    return dict(warmup_steps=warm, decay_steps=decay, wsd_decay_steps=wsd, increment=increment)


def schedule_steps(o: OptimizerConfig, t: TrainingConfig, global_batch_size: int) -> dict:
    """scheduler_steps for a run's optimizer and training settings."""
    return scheduler_steps(
        train_iters=t.train_iters,
        train_samples=t.train_samples,
        global_batch_size=global_batch_size,
        lr_decay_iters=o.lr_decay_iters,
        lr_decay_samples=o.lr_decay_samples,
        lr_warmup_iters=o.lr_warmup_iters,
        lr_warmup_samples=o.lr_warmup_samples,
        lr_warmup_fraction=o.lr_warmup_fraction,
        warmup=o.warmup,
        lr_wsd_decay_iters=o.lr_wsd_decay_iters,
        lr_wsd_decay_samples=o.lr_wsd_decay_samples,
    )

"""The training section of the config tree (`training.*`): iterations, batch sizes, evaluation, the
data loader. Part of megatron.config.schema (import them from here); declared the same way,
with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class TrainingConfig(Section):
    """The training loop: batch sizes, length, evaluation and exit conditions."""

    seed: int = setting(1234, "base random seed")
    micro_batch_size: int = setting(
        1, "samples per forward pass on one data-parallel rank", "--batch-size", min=1
    )
    global_batch_size: int | None = setting(
        None,
        "samples per optimizer step over all data-parallel ranks "
        "(default micro-batch-size x DP; the rest is gradient accumulation)",
    )
    gradient_accumulation_steps: int | None = setting(
        None,
        "micro batches per step on each data-parallel rank (v1.x --gas): global batch = "
        "micro-batch-size x DP x this; must agree with --global-batch-size if both are given",
        "--gas",
        min=1,
    )
    rampup_batch_size: tuple[int, int, int] | None = setting(
        None,
        "grow the global batch from START by INCREMENT over SAMPLES samples "
        "(needs --train-samples)",
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    train_iters: int | None = setting(None, "optimizer steps to train", min=1)
    train_samples: int | None = setting(
        None, "samples to train (instead of --train-iters; schedules count samples)", min=1
    )
    eval_interval: int = setting(1000, "iterations between validation runs", min=1)
    eval_iters: int = setting(100, "batches per validation run (0 disables validation)", min=0)
    exit_interval: int | None = setting(
        None, "save and exit when the iteration is a multiple of this", min=1
    )
    exit_duration_in_mins: float | None = setting(
        None, "save and exit after this many minutes of training", above=0
    )
    exit_signal_handler: bool = setting(
        False, "on SIGTERM: all ranks agree, save a checkpoint and exit 0"
    )
    clip_grad: float = setting(1.0, "clip the global gradient norm to this (0 disables)", min=0)
    max_skipped_in_a_row: int = setting(
        50, "stop with an error after this many consecutive skipped steps (overflow/NaN)", min=1
    )
    num_workers: int = setting(2, "DataLoader worker processes per rank", min=0)

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        if self.global_batch_size:
            return self.global_batch_size
        return self.micro_batch_size * data_parallel_size * (self.gradient_accumulation_steps or 1)

"""Rules of the logging section: the profiler window, Weights & Biases, the straggler detector."""

from __future__ import annotations

import importlib.util

from megatron.config.declare import fail
from megatron.config.schema_logging import LoggingConfig


def validate_logging(lg: LoggingConfig, world_size: int, deepspeed: bool = False) -> None:
    """Checked before any work, on every rank (so no rank waits for one that refused)."""
    _validate_straggler(lg, deepspeed)
    if lg.profile:
        if lg.profile_step_end <= lg.profile_step_start:
            fail(
                "--profile-step-start/--profile-step-end",
                f"need 0 <= start < end, got {lg.profile_step_start} and {lg.profile_step_end}",
                "e.g. --profile-step-start 10 --profile-step-end 12 (records 2 iterations)",
            )
        bad = [r for r in lg.profile_ranks if not 0 <= r < world_size]
        if bad or not lg.profile_ranks:
            fail(
                "--profile-ranks",
                f"{list(lg.profile_ranks)} is not a non-empty list of ranks below {world_size}",
                "pass e.g. --profile-ranks 0",
            )
    else:
        for flag, given in (
            ("--profile-ranks", lg.profile_ranks != (0,)),
            ("--profile-dir", lg.profile_dir is not None),
        ):
            if given:
                fail(flag, "given without --profile", "add --profile, or drop the flag")
    if lg.wandb_project is None:
        for flag, value in (
            ("--wandb-exp-name", lg.wandb_exp_name),
            ("--wandb-save-dir", lg.wandb_save_dir),
        ):
            if value is not None:
                fail(flag, "given without --wandb-project", "add --wandb-project NAME")
    elif importlib.util.find_spec("wandb") is None:
        fail(
            "--wandb-project",
            "the wandb package is not installed",
            "pip install wandb (or pip install 'megatron-3d[wandb]'), or drop --wandb-project",
        )


def _validate_straggler(lg: LoggingConfig, deepspeed: bool) -> None:
    if not lg.log_straggler:
        for flag, given in (
            ("--straggler-minmax-count", lg.straggler_minmax_count != 1),
            ("--straggler-ctrlr-port", lg.straggler_ctrlr_port != 65535),
            ("--disable-straggler-on-startup", lg.disable_straggler_on_startup),
        ):
            if given:
                fail(flag, "given without --log-straggler", "add --log-straggler, or drop the flag")
    elif deepspeed:
        fail(
            "--log-straggler",
            "DeepSpeed's engine runs the backward, the gradient reduction and the step as one "
            "call, so a rank's compute cannot be told from its wait for the others",
            "drop --log-straggler (or --deepspeed)",
        )

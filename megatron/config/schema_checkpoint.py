"""The checkpoint section of the config tree (`checkpoint.*`): --save, --load and how.
Part of megatron.config.schema (import them from here); declared the same way, with
`setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Saving and resuming (beside the checkpoints: run_config.yaml, this run's config)."""

    save: str | None = setting(None, "directory to save checkpoints in")
    load: str | None = setting(None, "directory to resume from")
    save_interval: int | None = setting(None, "iterations between saves", min=1)
    no_load_optim: bool = setting(False, "do not load optimizer state")
    no_load_rng: bool = setting(False, "do not load RNG states")
    no_save_optim: bool = setting(
        False,
        "save weights without optimizer and LR-schedule state (resuming then needs "
        "--no-load-optim or --finetune)",
    )
    no_save_rng: bool = setting(
        False, "save without RNG states (resuming then needs --no-load-rng or --finetune)"
    )
    finetune: bool = setting(False, "load weights only and start from iteration 0")
    save_retain_last: int | None = setting(None, "keep only the newest K complete checkpoints")
    async_save: bool = setting(
        False,
        "write checkpoints on a background thread (Megatron-core's flag): training waits only "
        "for a host copy of the state; the same files, marker and pointer as a synchronous "
        "save, committed at a later step (at most one save in flight; exit waits for it)",
    )

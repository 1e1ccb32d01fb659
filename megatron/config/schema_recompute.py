"""The recompute section of the config tree (`recompute.*`): activation recomputation. A run-time
switch that changes no weight, so never saved in checkpoints. Part of megatron.config.schema
(import them from there); declared the same way, with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class RecomputeConfig(Section):
    """Activation recompute: trade compute for memory; not saved in checkpoints."""

    granularity: str | None = setting(
        None,
        "full: recompute whole layers in backward; selective: only the attention core",
        flag="--recompute-granularity",
        choices=("full", "selective"),
        shortcuts={
            "--checkpoint-activations": (
                "full",
                "classic flag: --recompute-granularity full --recompute-method uniform",
            )
        },
    )
    method: str = setting(
        "uniform",
        "full: checkpoint every group of N layers (uniform) or only the first N layers of "
        "each stage (block)",
        flag="--recompute-method",
        choices=("uniform", "block"),
    )
    num_layers: int = setting(
        1,
        "N for --recompute-method",
        "--checkpoint-num-layers",
        flag="--recompute-num-layers",
        min=1,
    )
    distribute_saved_activations: bool = setting(
        False,
        "full recompute: keep only 1/TP of each checkpointed layer input on every TP rank and "
        "all-gather it for the recompute (memory / TP)",
        "--distribute-checkpointed-activations",
    )


# (rank, world size, local rank) variables of each launcher, in order of precedence.

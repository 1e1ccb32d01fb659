"""The resilience settings: torchft's fault tolerance of replica groups (fields of
`ParallelConfig`) and the straggler detector (fields of `LoggingConfig`).

Declared here for size; the sections derive from these classes, so the flags, config-file keys
(`parallel.ft_group_size`, `logging.log_straggler`) and defaults are theirs. Rules between
settings: megatron.config.rules_ft and megatron.config.rules_logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class FaultToleranceSettings(Section):
    """torchft's per-step fault tolerance (megatron/resilience/fault_tolerance.py)."""

    fault_tolerance: bool = setting(
        False,
        "torchft's per-step fault tolerance of data-parallel replica groups: each replica "
        "group (TP ranks, launched as a job of its own) averages its gradients with the "
        "replicas alive at that step, a dead one is dropped without a restart, a restarted one "
        "fetches the weights and optimizer state from a live peer (docs/operations.md)",
    )
    ft_replica_id: int = setting(
        0, "--fault-tolerance: this replica group's index, 0 to --ft-group-size - 1", min=0
    )
    ft_group_size: int = setting(
        1,
        "--fault-tolerance: the replica groups at full strength; the data-parallel size of "
        "--global-batch-size (each group reads its 1 / N share of it)",
        min=1,
    )
    ft_min_replica_size: int = setting(
        1, "--fault-tolerance: a step commits only with at least this many replica groups", min=1
    )
    ft_lighthouse: str | None = setting(
        None,
        "--fault-tolerance: the torchft lighthouse's address, e.g. http://HOST:29510 "
        "(default: $TORCHFT_LIGHTHOUSE); start it with `torchft_lighthouse --min_replicas 1`",
    )
    ft_max_retries: int = setting(
        3,
        "--fault-tolerance: steps in a row that may fail to commit (a replica group raised or "
        "died) before the run stops",
        min=0,
    )
    ft_timeout_seconds: float = setting(
        60.0,
        "--fault-tolerance: how long a cross-replica all-reduce, a commit or a recovery from a "
        "peer may take before the step is given up and redone (a quorum waits at least 60 s)",
        above=0,
    )


@dataclass(frozen=True)
class StragglerSettings(Section):
    """The straggler detector (--log-straggler, megatron/resilience/straggler.py)."""

    log_straggler: bool = setting(
        False,
        "every --log-interval, gather each rank's forward/backward/optimizer/data/communication "
        "times (one all-gather of a few floats) and log the slowest ranks, their host and how "
        "much slower than the median they are; TensorBoard/W&B get the spread",
    )
    straggler_minmax_count: int = setting(
        1, "--log-straggler: how many of the slowest (and fastest) ranks the report names", min=1
    )
    straggler_ctrlr_port: int = setting(
        65535,
        "--log-straggler: rank 0 listens on this TCP port; any connection (curl HOST:PORT) "
        "toggles the detector on/off at the next log line",
        min=1,
        max=65535,
    )
    disable_straggler_on_startup: bool = setting(
        False,
        "--log-straggler: start with the detector off (turn it on through --straggler-ctrlr-port)",
    )

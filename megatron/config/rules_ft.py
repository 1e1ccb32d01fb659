"""Rules of --fault-tolerance (torchft replica groups, megatron.resilience.fault_tolerance).

Each replica group is a job of its own (its own launcher, MASTER_PORT and process groups) that
holds one whole copy of the model; the data-parallel dimension is the replica groups, whose
gradients torchft averages step by step. What cannot be proven equal to one process on gloo
here is refused with its reason. That torchft is installed and the lighthouse answers is
checked at start-up (megatron.resilience.fault_tolerance)."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig

_WITHOUT = "--fault-tolerance is off"


def validate_fault_tolerance(cfg: MegatronConfig) -> None:
    par = cfg.parallel
    if not par.fault_tolerance:
        for flag, given in (
            ("--ft-replica-id", par.ft_replica_id != 0),
            ("--ft-group-size", par.ft_group_size != 1),
            ("--ft-min-replica-size", par.ft_min_replica_size != 1),
            ("--ft-lighthouse", par.ft_lighthouse is not None),
        ):
            if given:
                fail(flag, f"given but {_WITHOUT}", f"add --fault-tolerance or drop {flag}")
        return
    if par.ft_replica_id >= par.ft_group_size:
        fail(
            "--ft-replica-id",
            f"{par.ft_replica_id} is not below --ft-group-size {par.ft_group_size}",
            "number the replica groups 0 to --ft-group-size - 1",
        )
    if par.ft_min_replica_size > par.ft_group_size:
        fail(
            "--ft-min-replica-size",
            f"{par.ft_min_replica_size} is above --ft-group-size {par.ft_group_size}: no step "
            "could ever commit",
            "use at most --ft-group-size",
        )
    _refuse_layouts(cfg)
    refuse_pairs(cfg, "--fault-tolerance")  # megatron.config.rules_pairs


def _refuse_layouts(cfg: MegatronConfig) -> None:
    par = cfg.parallel
    model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    if par.world_size != model_parallel * par.context_parallel_size:
        fail(
            "--fault-tolerance",
            f"this replica group was launched with {par.world_size} processes, not one model "
            f"copy ({model_parallel} = TP x PP): data parallelism with --fault-tolerance is the "
            "replica groups themselves",
            "launch each replica group as its own job of TP x PP processes (1 today) with "
            "--ft-replica-id, and set --ft-group-size to the number of groups",
        )
    for flag, size, why in (
        (
            "--tensor-model-parallel-size",
            par.tensor_model_parallel_size,
            "a replica group of several TP ranks (a torchft manager per TP rank) is not proven "
            "against one process yet, and a lost TP peer takes its whole group down",
        ),
        (
            "--pipeline-model-parallel-size",
            par.pipeline_model_parallel_size,
            "a lost stage takes its replica down and a replica of several stages is not tested",
        ),
        ("--context-parallel-size", par.context_parallel_size, "not tested with torchft"),
        (
            "--expert-model-parallel-size",
            par.expert_model_parallel_size,
            "expert-parallel groups are carved from data parallelism, which is now the replicas",
        ),
    ):
        if size > 1:
            fail(flag, f"{size} with --fault-tolerance: {why}", f"use {flag} 1")

"""The parallel section of the config tree (`parallel.*`): how the ranks are split (tensor,
context, expert, pipeline and data parallel), the pipeline schedule, --auto-parallel and
torchft's replica groups (--fault-tolerance, --ft-*). Part of megatron.config.schema (import
them from there); declared the same way, with `setting(default, help, *aliases, ...)`.
Rules between settings: megatron.config.rules (and its rules_pipeline, rules_ft modules).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting
from megatron.schedules.base import PipelineSchedule
from megatron.schedules.registry import (
    OVERLAPS_PAIRS,
    SCHEDULES,
    flag_help,
    resolve_schedule,
)

LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, deepspeed, torch.distributed.launch
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # OpenMPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH, Intel MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH
)


# the schedules whose forward / backward pairs run overlapped (megatron.schedules)
_PAIRED = " / ".join(OVERLAPS_PAIRS)


@dataclass(frozen=True)
class _ParallelFields(Section):
    """The rank grid's fields of ParallelConfig (declared first, so they lead in --help)."""

    tensor_model_parallel_size: int = setting(
        1, "tensor-parallel ranks per layer", "--model-parallel-size", min=1
    )
    pipeline_model_parallel_size: int = setting(
        1,
        "pipeline stages (v1.x --pipe-parallel-size 0, no pipeline, means 1)",
        "--pipe-parallel-size",
        min=1,
    )
    context_parallel_size: int = setting(
        1,
        "context-parallel ranks per sequence (CP): each sample's sequence is cut into 2 x CP "
        "chunks, CP rank r holding chunks r and 2 CP - 1 - r, and attention passes keys and "
        "values round the CP group (ring attention); needs --seq-length divisible by 2 x CP",
        min=1,
    )
    expert_model_parallel_size: int = setting(
        1,
        "expert-parallel ranks (EP), carved from the data-parallel x context-parallel ones: "
        "each holds E / EP experts of every MoE layer and tokens go to them by all-to-all; "
        "expert gradients are averaged over the DP x CP / EP ranks holding the same experts",
        min=1,
    )
    expert_tensor_parallel_size: int | None = setting(
        None,
        "expert-tensor-parallel ranks (ETP): 1 replicates every expert over the TP group, the "
        "TP size splits each expert's FFN over it as the dense MLP is (fc1 column-, fc2 "
        "row-parallel; with --sequence-parallel the TP group's tokens are gathered for the "
        "experts and their outputs scattered back); no other size (default: the TP size, as "
        "in Megatron-core; 1 with --deepspeed, as in Megatron-DeepSpeed)",
        min=1,
    )
    moe_token_dispatcher_type: str = setting(
        "alltoall",
        "how tokens reach their experts' EP rank: alltoall (each token sent where it goes), or "
        "allgather (every token gathered on every EP rank, outputs reduce-scattered back)",
        choices=("alltoall", "allgather"),
    )
    num_layers_per_virtual_pipeline_stage: int | None = setting(
        None, "layers per model chunk for the interleaved pipeline schedule", min=1
    )
    pipeline_schedule: str | None = setting(None, flag_help(), choices=SCHEDULES)
    overlap_moe_expert_parallel_comm: bool | None = setting(
        None,
        "hide the MoE token all-to-alls (EP > 1, alltoall dispatcher) behind compute: "
        f"--pipeline-schedule {_PAIRED} runs each steady-state pair, the forward of one micro "
        "batch and the backward of another, in two threads that take turns at the "
        "all-to-alls, so one's tokens travel while the other computes (the same numbers as "
        f"running them one after the other). Default: on wherever {_PAIRED} has EP all-to-alls "
        "(what DualPipeV is; torchtitan's pipeline_parallel_expert_parallel_overlap)",
        shortcuts={
            "--no-overlap-moe-expert-parallel-comm": (
                False,
                f"run {_PAIRED}'s forward / backward pairs one after the other",
            )
        },
    )
    sequence_parallel: bool = setting(
        False,
        "split the activations outside the tensor-parallel regions (norms, dropout, residuals) "
        "along the sequence over the TP group, s / TP tokens per rank (needs TP > 1 and a "
        "sequence length divisible by TP)",
    )
    auto_parallel: bool = setting(
        False,
        "choose TP, PP, virtual stages, --sequence-parallel, the micro batch and recompute for "
        "the launched world size with the planner (tools/plan_parallel.py): the fastest layout "
        "predicted to fit; those of them given away from their defaults stay as given; the "
        "resolved run config records the choice (with auto_parallel off)",
    )
    auto_parallel_gpu_memory_gb: float | None = setting(
        None,
        "GiB per GPU for --auto-parallel (default: the first CUDA device's total memory)",
        above=0,
    )
    auto_parallel_gpus_per_node: int = setting(
        8,
        "GPUs per node for --auto-parallel (TP within a node, DP / PP traffic across nodes)",
        min=1,
    )
    auto_parallel_overhead_gb: float = setting(
        1.0,
        "GiB per GPU the planner reserves for the framework (CUDA context, allocator cache)",
        min=0,
    )


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
class ParallelConfig(FaultToleranceSettings, _ParallelFields):
    """How the ranks are split: TP fastest, then CP, then DP, then PP.

    torchft's fault-tolerance fields (--fault-tolerance, --ft-*) follow the rank grid's."""

    world_size: int = setting(
        1,
        "processes in the job, set by the launcher (WORLD_SIZE or SLURM_NTASKS)",
        from_env=True,
        min=1,
    )

    @property
    def data_parallel_size(self) -> int:
        """DP ranks of the job; with --fault-tolerance the replica groups at full strength."""
        groups = self.ft_group_size if self.fault_tolerance else 1
        return (
            groups
            * self.world_size
            // (
                self.tensor_model_parallel_size
                * self.context_parallel_size
                * self.pipeline_model_parallel_size
            )
        )

    @property
    def expert_tp_size(self) -> int:
        """--expert-tensor-parallel-size, or the TP size when not given."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def schedule(self) -> PipelineSchedule:
        """--pipeline-schedule, or the one the other flags imply (megatron.schedules)."""
        chunked = self.num_layers_per_virtual_pipeline_stage is not None
        return resolve_schedule(self.pipeline_schedule, chunked)

    @property
    def resolved_pipeline_schedule(self) -> str:
        return self.schedule.name

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank (None: one, not interleaved)."""
        per_stage = num_layers // self.pipeline_model_parallel_size
        return self.schedule.model_chunks(per_stage, self.num_layers_per_virtual_pipeline_stage)

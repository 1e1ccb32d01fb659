"""Rules of --pipeline-schedule: which schedule the other pipeline flags allow."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig
from megatron.schedules.base import PipelineSchedule
from megatron.schedules.one_f_one_b import ONE_F_ONE_B
from megatron.schedules.registry import OVERLAPS_PAIRS, default_schedule
from megatron.schedules.zero_bubble import ZB_H1

_FLAG = "--pipeline-schedule"


def validate_pipeline_schedule(cfg: MegatronConfig) -> None:
    par = cfg.parallel
    schedule, vlayers = par.schedule, par.num_layers_per_virtual_pipeline_stage
    if par.pipeline_schedule is None:
        if par.overlap_moe_expert_parallel_comm:
            _validate_overlap(cfg)
        return  # the default: 1F1B, or interleaved with --num-layers-per-virtual-pipeline-stage
    if par.pipeline_model_parallel_size < 2:
        fail(
            f"{_FLAG} {schedule}",
            "a pipeline schedule needs pipeline stages",
            "raise --pipeline-model-parallel-size to 2 or more, or drop the flag",
        )
    if schedule.chunks is None and vlayers is None:
        fail(
            f"{_FLAG} {schedule}",
            f"the {schedule} schedule needs model chunks",
            "add --num-layers-per-virtual-pipeline-stage (layers per chunk)",
        )
    if schedule.chunks == 1 and vlayers is not None:
        fail(
            f"{_FLAG} {schedule}",
            f"{schedule} runs one model chunk per stage, but "
            "--num-layers-per-virtual-pipeline-stage asks for several",
            "drop --num-layers-per-virtual-pipeline-stage, or use --pipeline-schedule "
            f"{default_schedule(chunked=True)}",
        )
    if schedule.v_shape:
        _validate_v_shape(cfg, schedule)
    if par.overlap_moe_expert_parallel_comm:
        _validate_overlap(cfg)
    if cfg.deepspeed.enabled and schedule is not ONE_F_ONE_B:
        fail(
            f"{_FLAG} {schedule}",
            "DeepSpeed's pipeline engine runs its own 1F1B schedule",
            "drop --pipeline-schedule (or --deepspeed: our pipeline runs every schedule)",
        )


def _validate_v_shape(cfg: MegatronConfig, schedule: PipelineSchedule) -> None:
    """Two chunks per stage in a V: 2 P chunks of equal layer counts."""
    par, m = cfg.parallel, cfg.model
    pp, vlayers = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    if m.num_layers % (2 * pp):
        fail(
            f"{_FLAG} {schedule}",
            f"the V places two chunks on each of the {pp} stages, but --num-layers "
            f"{m.num_layers} does not divide into {2 * pp} chunks",
            f"use a layer count divisible by 2 x --pipeline-model-parallel-size = {2 * pp}",
        )
    if vlayers is not None and vlayers * 2 * pp != m.num_layers:
        fail(
            f"{_FLAG} {schedule}",
            f"{schedule} runs exactly two chunks per stage ({m.num_layers // (2 * pp)} layers "
            f"each), but --num-layers-per-virtual-pipeline-stage {vlayers} asks for "
            f"{m.num_layers // pp // vlayers if vlayers else 0}",
            "drop --num-layers-per-virtual-pipeline-stage (the V sets it)",
        )
    if m.num_unique_layers is not None:
        fail(
            f"{_FLAG} {schedule}",
            "--num-unique-layers shares weights between layers, which the V places on "
            "chunks the sharing rules do not know",
            f"drop --num-unique-layers, or use --pipeline-schedule {ZB_H1}",
        )


def overlaps_moe_pairs(cfg: MegatronConfig) -> bool:
    """Whether the schedule's forward / backward pairs run overlapped (DualPipeV's): it
    overlaps them where the model's MoE layers exchange tokens by all-to-all over EP > 1
    (megatron.schedules.base.PipelineSchedule.overlaps_moe_pairs), and
    --no-overlap-moe-expert-parallel-comm was not given."""
    par = cfg.parallel
    return par.overlap_moe_expert_parallel_comm is not False and par.schedule.overlaps_moe_pairs(
        par.pipeline_model_parallel_size, par.expert_model_parallel_size, _has_all_to_alls(cfg)
    )


def _has_all_to_alls(cfg: MegatronConfig) -> bool:
    par = cfg.parallel
    return (
        bool(cfg.model.num_experts)
        and par.expert_model_parallel_size > 1
        and par.moe_token_dispatcher_type == "alltoall"
    )


def _validate_overlap(cfg: MegatronConfig) -> None:
    """--overlap-moe-expert-parallel-comm given: refused where nothing would overlap."""
    flag, paired = "--overlap-moe-expert-parallel-comm", " / ".join(OVERLAPS_PAIRS)
    if not cfg.parallel.schedule.overlaps_pairs:
        fail(
            flag,
            f"only the {paired} schedule overlaps one micro batch's all-to-alls with another's "
            f"compute here, not {cfg.parallel.schedule} (Megatron-core's "
            "combined 1F1B is not implemented)",
            f"add --pipeline-schedule {paired}, or drop the flag",
        )
    if not _has_all_to_alls(cfg):
        fail(
            flag,
            "there are no MoE token all-to-alls to hide: it needs --num-experts, "
            "--expert-model-parallel-size > 1 and --moe-token-dispatcher-type alltoall",
            "set those, or drop the flag",
        )

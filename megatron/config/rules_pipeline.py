"""Rules of --pipeline-schedule: which schedule the other pipeline flags allow."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig

_FLAG = "--pipeline-schedule"


def validate_pipeline_schedule(cfg: MegatronConfig) -> None:
    par = cfg.parallel
    schedule, vlayers = par.pipeline_schedule, par.num_layers_per_virtual_pipeline_stage
    if schedule is None:
        return  # 1f1b, or interleaved with --num-layers-per-virtual-pipeline-stage
    if schedule in ("zbv", "dualpipev"):
        fail(
            f"{_FLAG} {schedule}",
            "the V-shaped schedules (two model chunks per stage, the last virtual stage and "
            "the loss on the first stage) exist as orders in megatron/pipeline_order.py and its "
            "simulator, but this trainer does not build the V placement of the model yet",
            "use --pipeline-schedule zb-h1 (zero bubble at 1F1B's placement), or interleaved",
        )
    if par.pipeline_model_parallel_size < 2:
        fail(
            f"{_FLAG} {schedule}",
            "a pipeline schedule needs pipeline stages",
            "raise --pipeline-model-parallel-size to 2 or more, or drop the flag",
        )
    if schedule == "interleaved" and vlayers is None:
        fail(
            f"{_FLAG} interleaved",
            "the interleaved schedule needs model chunks",
            "add --num-layers-per-virtual-pipeline-stage (layers per chunk)",
        )
    if schedule in ("1f1b", "zb-h1") and vlayers is not None:
        fail(
            f"{_FLAG} {schedule}",
            f"{schedule} runs one model chunk per stage, but "
            "--num-layers-per-virtual-pipeline-stage asks for several",
            "drop --num-layers-per-virtual-pipeline-stage, or use --pipeline-schedule interleaved",
        )
    if cfg.deepspeed.enabled and schedule != "1f1b":
        fail(
            f"{_FLAG} {schedule}",
            "DeepSpeed's pipeline engine runs its own 1F1B schedule",
            "drop --pipeline-schedule (or --deepspeed: our pipeline runs every schedule)",
        )

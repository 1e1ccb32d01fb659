"""Rules of --use-torch-fsdp2 (torch's FSDP2 over the DP x CP ranks, megatron.data_parallel.fsdp2):
what it replaces, and what it has not been proven to compose with."""

from __future__ import annotations

from megatron.config.declare import fail
from megatron.config.rules_pairs import refuse_pairs
from megatron.config.schema import MegatronConfig
from megatron.schedules.registry import Names

FLAG = "--use-torch-fsdp2"


def validate_fsdp2(cfg: MegatronConfig) -> None:
    d = cfg.distributed
    if not d.use_torch_fsdp2:
        if d.torch_fsdp2_reshard_after_forward != "auto":
            fail(
                "--torch-fsdp2-reshard-after-forward / --torch-fsdp2-no-reshard-after-forward",
                "given without --use-torch-fsdp2 (nothing is sharded)",
                "add --use-torch-fsdp2 or drop the flag",
            )
        return
    refuse_pairs(cfg, FLAG)  # megatron.config.rules_pairs
    if cfg.parallel.schedule.split_backward:
        fail(
            FLAG,
            f"given with --pipeline-schedule {cfg.parallel.pipeline_schedule}: a zero-bubble "
            "schedule computes weight gradients after the backward that FSDP2 reduce-scatters "
            "them in; the two are not wired together",
            f"use --pipeline-schedule {' or '.join(Names(lambda s: not s.split_backward))} with "
            "--use-torch-fsdp2, or --use-distributed-optimizer with the zero-bubble schedules",
        )

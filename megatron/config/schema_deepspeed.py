"""The deepspeed section of the config tree (`deepspeed.*`): --deepspeed and the classic Megatron-
DeepSpeed flags. Part of megatron.config.schema (import them from here); declared the same way,
with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class DeepSpeedConfig(Section):
    """--deepspeed and the classic Megatron-DeepSpeed flags (None: not given, the JSON decides).

    The spellings are those deepspeed.add_config_arguments defines, without importing deepspeed
    to parse them.
    """

    enabled: bool = setting(
        False,
        "train through DeepSpeed (pip install --no-build-isolation deepspeed)",
        flag="--deepspeed",
    )
    config: str | None = setting(
        None,
        "DeepSpeed JSON; filled from these flags where it is silent",
        "--deepspeed-config",
        flag="--deepspeed_config",
    )
    config_json: dict | None = setting(
        None, "the --deepspeed_config file's content, read once before start-up", resolved=True
    )
    zero_stage: int | None = setting(None, "ZeRO stage (overrides the JSON)", choices=(0, 1, 2, 3))
    zero_reduce_scatter: bool | None = setting(
        None, "ZeRO: reduce-scatter gradients (overrides the JSON)"
    )
    zero_contigious_gradients: bool | None = setting(
        None, "ZeRO: copy gradients to a contiguous buffer (overrides the JSON)"
    )
    zero_reduce_bucket_size: int | None = setting(
        None, "ZeRO: elements per reduce bucket (overrides the JSON)"
    )
    zero_allgather_bucket_size: int | None = setting(
        None, "ZeRO: elements per all-gather bucket (overrides the JSON)"
    )
    cpu_optimizer: bool = setting(
        False,
        "keep the fp32 master weights and optimizer states on the CPU and step there "
        "(with --deepspeed: ZeRO offload_optimizer with DeepSpeedCPUAdam)",
    )
    cpu_torch_adam: bool = setting(
        False,
        "with --cpu-optimizer: torch's AdamW on the CPU instead of DeepSpeed's CPU Adam kernel",
        "--cpu-torch-adam",
        flag="--cpu_torch_adam",
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute through deepspeed.checkpointing instead of our mpu checkpoint (implied by "
        "--partition-activations/--checkpoint-in-cpu/--contigious-checkpointing/"
        "--synchronize-each-layer/--profile-backward)",
        flag="--deepspeed-activation-checkpointing",
    )
    partition_activations: bool = setting(
        False, "DeepSpeed recompute: split checkpointed activations over TP ranks"
    )
    checkpoint_in_cpu: bool = setting(
        False, "DeepSpeed recompute: keep checkpointed activations on the CPU"
    )
    contigious_checkpointing: bool = setting(
        False, "DeepSpeed recompute: copy checkpoints into one buffer"
    )
    synchronize_each_layer: bool = setting(
        False, "DeepSpeed recompute: synchronize the device after each layer"
    )
    profile_backward: bool = setting(False, "DeepSpeed recompute: time the backward of each layer")

"""The distributed section of the config tree (`distributed.*`): the collective backend and how the
data-parallel ranks reduce or shard gradients (our DDP buckets, torch DDP, FSDP2). Part of
megatron.config.schema (import them from here); declared the same way, with
`setting(default, help, *aliases, ...)`.
Rules between settings: megatron.config.rules (and its rules_fsdp2 module).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


@dataclass(frozen=True)
class DistributedConfig(Section):
    """Process groups and data-parallel gradient reduction."""

    backend: str | None = setting(
        None,
        "collective backend (default nccl on CUDA, gloo on CPU)",
        flag="--distributed-backend",
        choices=("nccl", "gloo"),
    )
    timeout_minutes: float = setting(
        10.0,
        "a collective that waits longer fails the job",
        flag="--distributed-timeout-minutes",
        above=0,
    )
    local_rank: int | None = setting(
        None, "set by some launchers; LOCAL_RANK from the environment wins", "--local_rank"
    )
    ddp_bucket_size: int = setting(
        40_000_000, "gradient elements per data-parallel all-reduce bucket"
    )
    overlap_grad_reduce: bool = setting(
        True, "all-reduce gradients after backward instead of during it"
    )
    ddp_impl: str = setting(
        "local",
        "data parallelism: local = our fp32 gradient buckets; torch = "
        "torch.nn.parallel.DistributedDataParallel (PP = 1, fp32 weights)",
        "--DDP-impl",
        choices=("local", "torch"),
    )
    allreduce_dtype: str = setting(
        "fp32",
        "dtype of the data-parallel gradient all-reduce: fp32, or params = the fp16/bf16 "
        "weights' dtype (half the traffic; gradients still accumulate in fp32)",
        choices=("fp32", "params"),
        shortcuts={"--fp32-allreduce": ("fp32", "classic flag: --allreduce-dtype fp32")},
    )
    use_cpu_initialization: bool = setting(
        False, "build the model on the CPU, then move it to the device (the same weights)"
    )
    use_torch_fsdp2: bool = setting(
        False,
        "shard weights, gradients and optimizer state over the data-parallel (x context-"
        "parallel) ranks with torch's FSDP2 (torch.distributed.fsdp.fully_shard, per "
        "transformer layer): weights all-gathered before each layer runs, gradients "
        "reduce-scattered (ZeRO-3); replaces our DDP buckets",
    )
    torch_fsdp2_reshard_after_forward: str = setting(
        "auto",
        "with --use-torch-fsdp2: free each unit's gathered weights after its forward and gather "
        "them again for backward (true, ZeRO-3), keep them until backward (false: one "
        "all-gather per step fewer, ZeRO-2's memory for the weights), or auto: true for the "
        "layers, false for each model chunk's root unit (FSDP2's reshard_after_forward=None)",
        choices=("auto", "true", "false"),
        shortcuts={
            "--torch-fsdp2-no-reshard-after-forward": (
                "false",
                "Megatron-core's spelling of --torch-fsdp2-reshard-after-forward false",
            )
        },
    )

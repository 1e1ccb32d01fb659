"""Rules of --use-torch-fsdp2 (torch's FSDP2 over the DP x CP ranks, megatron.data_parallel.fsdp2):
what it replaces, and what it has not been proven to compose with."""

from __future__ import annotations

import dataclasses

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig

FLAG = "--use-torch-fsdp2"


def _default(section, name: str):
    return next(f.default for f in dataclasses.fields(section) if f.name == name)


def _clashes(cfg: MegatronConfig) -> tuple[tuple[str, bool, str, str], ...]:
    """(flag, given?, why they cannot run together, the fix)."""
    d, k = cfg.distributed, cfg.kernels
    return (
        (
            "--deepspeed",
            cfg.deepspeed.enabled,
            "DeepSpeed's engine owns the data parallelism (its ZeRO-3 shards the weights)",
            "drop --use-torch-fsdp2 (--zero-stage 3 is DeepSpeed's own sharding), or drop "
            "--deepspeed",
        ),
        (
            "--use-distributed-optimizer",
            cfg.optimizer.use_distributed_optimizer,
            "FSDP2 already shards the optimizer state (with the weights and gradients); the "
            "distributed optimizer needs our DDP's buckets, which FSDP2 replaces",
            "choose one: --use-torch-fsdp2 (ZeRO-3) or --use-distributed-optimizer (ZeRO-1)",
        ),
        (
            "--DDP-impl torch",
            d.ddp_impl == "torch",
            "torch's DistributedDataParallel all-reduces whole gradients; FSDP2 replaces it",
            "drop --DDP-impl torch",
        ),
        (
            "--ddp-bucket-size",
            d.ddp_bucket_size != _default(d, "ddp_bucket_size"),
            "FSDP2 gathers and reduces per layer (its units), not in buckets",
            "drop --ddp-bucket-size",
        ),
        (
            "--no-overlap-grad-reduce",
            not d.overlap_grad_reduce,
            "FSDP2 always reduce-scatters each layer's gradients during backward",
            "drop --no-overlap-grad-reduce",
        ),
        (
            "--cpu-optimizer",
            cfg.deepspeed.cpu_optimizer,
            "the sharded weights are the fp32 master weights and stay on the device",
            "drop --cpu-optimizer",
        ),
        (
            "--num-experts",
            cfg.model.moe,
            "MoE experts are reduced over the expert-data-parallel group, another mesh than "
            "the dense weights' (not built here)",
            "use --use-distributed-optimizer for MoE models",
        ),
        (
            "--num-unique-layers",
            (cfg.model.num_unique_layers or cfg.model.num_layers) < cfg.model.num_layers,
            "a shared layer runs several times per forward, and one FSDP2 unit gathered and "
            "freed per use is not proven here",
            "drop --num-unique-layers, or --use-torch-fsdp2",
        ),
        (
            "--torch-compile",
            k.torch_compile,
            "each chunk is compiled as one module, which FSDP2's per-layer hooks would cut "
            "into graph breaks; not proven here",
            "drop --torch-compile with --use-torch-fsdp2",
        ),
        (
            "--fp8-format",
            cfg.precision.fp8_format is not None,
            "float8 GEMMs with FSDP2 need torchao's float8 all-gather, not wired here",
            "drop --fp8-format with --use-torch-fsdp2, or use --use-distributed-optimizer",
        ),
        (
            f"--pipeline-schedule {cfg.parallel.pipeline_schedule}",
            cfg.parallel.pipeline_schedule in ("zb-h1", "zbv", "dualpipev"),
            "a zero-bubble schedule computes weight gradients after the backward that FSDP2 "
            "reduce-scatters them in; the two are not wired together",
            "use --pipeline-schedule 1f1b or interleaved with --use-torch-fsdp2, or "
            "--use-distributed-optimizer with the zero-bubble schedules",
        ),
    )


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
    for flag, given, why, fix in _clashes(cfg):
        if given:
            fail(FLAG, f"given with {flag}: {why}", fix)

"""Pairwise refusals: two features that cannot run together, each pair once, with why.

A row says: feature A (its rules check the row) refuses feature B, why, and the fix. `GIVEN`
says once when a feature counts as on. The rules of A call `refuse_pairs(cfg, A)` where its
other rules run, so which message a run with several clashes gets is unchanged; the message is
"FLAG: PROBLEM. Fix: FIX." (megatron.config.declare.fail), FLAG and PROBLEM from the row's
templates ({a}, {b}, {why} and the values of `_values`).

Adding a clash between two features is one row here (and an entry in GIVEN for a new feature).
Rules that name a pipeline schedule or an optimizer kind live with those (rules_pipeline.py,
rules_fsdp2.py's zero-bubble row, rules_training.py's Muon rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from megatron.config.declare import fail
from megatron.config.schema import MegatronConfig
from megatron.config.schema_distributed import DistributedConfig


def _default_bucket(d: DistributedConfig) -> int:
    return next(f.default for f in dataclasses.fields(d) if f.name == "ddp_bucket_size")


# When each feature of the table is on (as its flag, or the setting the messages name).
GIVEN: dict[str, Callable[[MegatronConfig], bool]] = {
    "--use-torch-fsdp2": lambda c: c.distributed.use_torch_fsdp2,
    "--fault-tolerance": lambda c: c.parallel.fault_tolerance,
    "--fp8-format": lambda c: c.precision.fp8_format is not None,
    "--use-distributed-optimizer": lambda c: c.optimizer.use_distributed_optimizer,
    "--context-parallel-size": lambda c: c.parallel.context_parallel_size > 1,
    "--cross-entropy-fusion-impl linear": lambda c: c.kernels.cross_entropy_fusion_impl == "linear",
    "--mtp-num-layers": lambda c: c.model.mtp_num_layers is not None,
    "--num-experts": lambda c: c.model.moe,
    "--sdpa-backend": lambda c: c.kernels.sdpa_backend != "auto",
    "--deepspeed": lambda c: c.deepspeed.enabled,
    "--deepspeed with pipeline stages": lambda c: (
        c.deepspeed.enabled and c.parallel.pipeline_model_parallel_size > 1
    ),
    "--DDP-impl torch": lambda c: c.distributed.ddp_impl == "torch",
    "--ddp-bucket-size": lambda c: c.distributed.ddp_bucket_size != _default_bucket(c.distributed),
    "--no-overlap-grad-reduce": lambda c: not c.distributed.overlap_grad_reduce,
    "--cpu-optimizer": lambda c: c.deepspeed.cpu_optimizer,
    "--allreduce-dtype params": lambda c: c.distributed.allreduce_dtype == "params",
    "--num-unique-layers": lambda c: (
        (c.model.num_unique_layers or c.model.num_layers) < c.model.num_layers
    ),
    "--torch-compile": lambda c: c.kernels.torch_compile,
    "--attention-backend fused": lambda c: c.kernels.attention_backend == "fused",
    "--fp16-lm-cross-entropy": lambda c: c.kernels.fp16_lm_cross_entropy,
}


def _values(cfg: MegatronConfig) -> dict[str, object]:
    """The settings a row's message may quote besides {a}, {b} and {why}."""
    return {
        "cp": cfg.parallel.context_parallel_size,
        "fp8_format": cfg.precision.fp8_format,
        "sdpa_backend": cfg.kernels.sdpa_backend,
    }


@dataclass(frozen=True)
class Pair:
    a: str  # the feature whose rules check the row
    b: str  # the feature it cannot run with
    why: str
    fix: str
    flag: str = "{a}"  # the flag the message leads with
    problem: str = "given with {b}: {why}"


_FSDP2 = "--use-torch-fsdp2"
_FT = dict(a="--fault-tolerance", flag="{b}", problem="cannot run with {a}: {why}")
_FP8 = dict(a="--fp8-format", flag="{a} {fp8_format}", problem="{why}")
_DIST_OPT = "--use-distributed-optimizer"
_SHARDED = ", our sharded buffers are needed"
_CP = dict(a="--context-parallel-size", problem="{cp} given with {b}: {why}")
_LINEAR_CE = "--cross-entropy-fusion-impl linear"

PAIRS: tuple[Pair, ...] = (
    Pair(
        _FSDP2,
        "--deepspeed",
        "DeepSpeed's engine owns the data parallelism (its ZeRO-3 shards the weights)",
        "drop --use-torch-fsdp2 (--zero-stage 3 is DeepSpeed's own sharding), or drop --deepspeed",
    ),
    Pair(
        _FSDP2,
        "--use-distributed-optimizer",
        "FSDP2 already shards the optimizer state (with the weights and gradients); the "
        "distributed optimizer needs our DDP's buckets, which FSDP2 replaces",
        "choose one: --use-torch-fsdp2 (ZeRO-3) or --use-distributed-optimizer (ZeRO-1)",
    ),
    Pair(
        _FSDP2,
        "--DDP-impl torch",
        "torch's DistributedDataParallel all-reduces whole gradients; FSDP2 replaces it",
        "drop --DDP-impl torch",
    ),
    Pair(
        _FSDP2,
        "--ddp-bucket-size",
        "FSDP2 gathers and reduces per layer (its units), not in buckets",
        "drop --ddp-bucket-size",
    ),
    Pair(
        _FSDP2,
        "--no-overlap-grad-reduce",
        "FSDP2 always reduce-scatters each layer's gradients during backward",
        "drop --no-overlap-grad-reduce",
    ),
    Pair(
        _FSDP2,
        "--cpu-optimizer",
        "the sharded weights are the fp32 master weights and stay on the device",
        "drop --cpu-optimizer",
    ),
    Pair(
        _FSDP2,
        "--num-experts",
        "MoE experts are reduced over the expert-data-parallel group, another mesh than "
        "the dense weights' (not built here)",
        "use --use-distributed-optimizer for MoE models",
    ),
    Pair(
        _FSDP2,
        "--num-unique-layers",
        "a shared layer runs several times per forward, and one FSDP2 unit gathered and "
        "freed per use is not proven here",
        "drop --num-unique-layers, or --use-torch-fsdp2",
    ),
    Pair(
        _FSDP2,
        "--torch-compile",
        "each chunk is compiled as one module, which FSDP2's per-layer hooks would cut "
        "into graph breaks; not proven here",
        "drop --torch-compile with --use-torch-fsdp2",
    ),
    Pair(
        _FSDP2,
        "--fp8-format",
        "float8 GEMMs with FSDP2 need torchao's float8 all-gather, not wired here",
        "drop --fp8-format with --use-torch-fsdp2, or use --use-distributed-optimizer",
    ),
    Pair(
        b="--deepspeed",
        why="DeepSpeed's engine owns the gradient all-reduce and the optimizer step; torchft "
        "must decide whether each step commits",
        fix="drop --deepspeed (our native backend) or --fault-tolerance",
        **_FT,
    ),
    Pair(
        b="--use-distributed-optimizer",
        why="a lost replica would take its optimizer shard with it; torchft recovers a "
        "replacement from a peer's whole optimizer state",
        fix="drop --use-distributed-optimizer",
        **_FT,
    ),
    Pair(
        b="--use-torch-fsdp2",
        why="torchft averages our DDP's flat gradient buffer between replica groups, which "
        "FSDP2 replaces; and a group holds one whole model copy, with nothing to shard",
        fix="drop --use-torch-fsdp2",
        **_FT,
    ),
    Pair(
        b="--DDP-impl torch",
        why="torchft averages our DDP's flat gradient buffer",
        fix="use --DDP-impl local",
        **_FT,
    ),
    Pair(
        b="--allreduce-dtype params",
        why="the cross-replica all-reduce runs in fp32",
        fix="use --allreduce-dtype fp32",
        **_FT,
    ),
    Pair(
        b="--num-experts",
        why="MoE (expert groups, router bias updates) is not tested with torchft",
        fix="drop --num-experts or --fault-tolerance",
        **_FT,
    ),
    Pair(
        b="--deepspeed",
        why="is not wired into --deepspeed (its engine and pipeline module build their own "
        "model path)",
        fix="drop --deepspeed (our backend runs TP, PP, DP and the distributed optimizer with "
        "fp8) or drop --fp8-format",
        **_FP8,
    ),
    Pair(
        b="--num-experts",
        why="the MoE experts' GEMMs are not float8 here: each expert's token count changes "
        "every step (float8 GEMMs need multiples of 16) and torchao's float8 grouped GEMM is a "
        "prototype",
        fix="drop --fp8-format or --num-experts",
        **_FP8,
    ),
    Pair(
        _DIST_OPT,
        "--deepspeed",
        "our sharded optimizer cannot run inside --deepspeed, whose ZeRO shards the optimizer "
        "itself",
        "drop --use-distributed-optimizer and pass --zero-stage 1 (ZeRO-1 shards the "
        "optimizer states like it; 2 also shards gradients, 3 weights), or drop --deepspeed",
        problem="{why}",
    ),
    Pair(
        _DIST_OPT,
        "--DDP-impl torch",
        "torch DDP all-reduces" + _SHARDED,
        "drop --DDP-impl torch (or --use-distributed-optimizer)",
    ),
    Pair(
        _DIST_OPT,
        "--cpu-optimizer",
        "its shards stay on the device" + _SHARDED,
        "drop --cpu-optimizer (or --use-distributed-optimizer)",
    ),
    Pair(
        _DIST_OPT,
        "--allreduce-dtype params",
        "it reduce-scatters the fp32 buckets" + _SHARDED,
        "drop --allreduce-dtype params (or --use-distributed-optimizer)",
    ),
    Pair(
        b="--deepspeed",
        why="DeepSpeed's engines know no context-parallel group (their ZeRO would reduce "
        "gradients over DP only)",
        fix="drop --deepspeed (the native backend's --use-distributed-optimizer shards the "
        "optimizer over DP x CP)",
        **_CP,
    ),
    Pair(
        b="--attention-backend fused",
        why="the Triton causal softmax needs the whole score row; ring attention merges "
        "per-block softmaxes by their log-sum-exp",
        fix="pass --attention-backend sdpa (each block through SDPA's fused kernels) or "
        "unfused (explicit fp32 math per block)",
        **_CP,
    ),
    Pair(
        _LINEAR_CE,
        "--fp16-lm-cross-entropy",
        "the fused loss keeps no fp32 logits already (and its chunks' math is fp32)",
        "drop --fp16-lm-cross-entropy",
        problem="given with {b}; {why}",
    ),
    Pair(
        _LINEAR_CE,
        "--deepspeed with pipeline stages",
        "DeepSpeed's pipeline engine computes the loss from the last layer's logits",
        "use --cross-entropy-fusion-impl native with --deepspeed and pipeline stages, or "
        "our own pipeline (drop --deepspeed)",
        problem="{why}",
    ),
    Pair(
        "--mtp-num-layers",
        "--deepspeed with pipeline stages",
        "DeepSpeed's pipeline engine passes only the hidden states between stages, and "
        "the MTP modules on the last stage need the tokens and the loss mask",
        "use our pipeline (drop --deepspeed) or --pipeline-model-parallel-size 1",
        problem="{why}",
    ),
    Pair(
        "--num-experts",
        "--DDP-impl torch",
        "torch DDP averages every gradient over DP (experts too) and fails on experts a "
        "micro batch never reached",
        "use --DDP-impl local (the default), which reduces expert gradients over the "
        "expert-data-parallel group",
    ),
    Pair(
        "--sdpa-backend",
        "--context-parallel-size",
        "whose ring attention picks its blocks' kernels itself (those that return the log-sum-exp)",
        "drop --sdpa-backend",
        problem="{sdpa_backend} given with {b} > 1, {why}",
    ),
)


def refuse_pairs(cfg: MegatronConfig, feature: str) -> None:
    """With `feature` on, fail on the first row of it whose other feature is on too."""
    if not GIVEN[feature](cfg):
        return
    for row in PAIRS:
        if row.a == feature and GIVEN[row.b](cfg):
            values = {"a": row.a, "b": row.b, "why": row.why, **_values(cfg)}
            fail(row.flag.format(**values), row.problem.format(**values), row.fix)

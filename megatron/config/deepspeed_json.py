"""The DeepSpeed JSON (--deepspeed_config) and the classic DeepSpeed flags, against the command
line (no deepspeed import).

Batch sizes, gradient accumulation, precision, loss scaling and clipping have one source: the
command line. Where the JSON is silent it is filled from the flags; where it states a value
that differs from the flags, that is a ConfigError naming the JSON key and the flag. The
classic ZeRO flags (--zero-stage, --zero-reduce-scatter, ...) override the JSON when given.
A JSON "optimizer" section (v1.x's ds_zero_stage_2_config.json has one) fills the optimizer
flags the command line did not give, and contradicts the ones it gave.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

from megatron.config.declare import ConfigError, fail
from megatron.config.optimizers import kinds as optimizer_kinds
from megatron.config.schema import MegatronConfig

_JSON_OPTIMIZER_PARAMS = {
    "lr": ("optimizer.lr", "--lr"),
    "eps": ("optimizer.adam_eps", "--adam-eps"),
    "weight_decay": ("optimizer.weight_decay", "--weight-decay"),
    "max_grad_norm": ("training.clip_grad", "--clip-grad"),
}


def json_optimizer_values(section: object, where: str) -> dict[str, tuple[object, str, str]]:
    """{config path: (value, JSON key, flag)} of a DeepSpeed JSON "optimizer" section.

    Only what our optimizer (AdamW) can honour is accepted; anything else is a ConfigError."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}optimizer in the DeepSpeed JSON must be an object")
    kind = str(section.get("type", "Adam"))
    params = dict(section.get("params", {}))
    ours = [k.name for k in optimizer_kinds() if kind.lower() in k.deepspeed_types]
    if not ours or params.pop("adam_w_mode", True) is not True:
        raise ConfigError(
            f"'optimizer' in the DeepSpeed JSON: type {kind!r} cannot be honoured; the optimizer "
            "comes from --optimizer/--lr/--weight-decay/--adam-* (AdamW or SGD). Fix: remove "
            "'optimizer' from the JSON, or use type Adam/AdamW"
        )
    out = {"optimizer.optimizer": (ours[0], "optimizer.type", "--optimizer")}
    if "betas" in params:
        b1, b2 = params.pop("betas")
        out["optimizer.adam_beta1"] = (float(b1), "optimizer.params.betas[0]", "--adam-beta1")
        out["optimizer.adam_beta2"] = (float(b2), "optimizer.params.betas[1]", "--adam-beta2")
    for key, value in params.items():
        if key not in _JSON_OPTIMIZER_PARAMS:
            raise ConfigError(
                f"'optimizer.params.{key}' in the DeepSpeed JSON has no flag here. Fix: remove "
                f"it (known: betas, {', '.join(_JSON_OPTIMIZER_PARAMS)})"
            )
        path, flag = _JSON_OPTIMIZER_PARAMS[key]
        out[path] = (float(value), f"optimizer.params.{key}", flag)
    return out


def fill_from_ds_json(values: dict[str, object]) -> None:
    """Read the --deepspeed_config file once (its content travels in deepspeed.config_json) and
    fill the optimizer flags not given from its "optimizer" section; a value there that
    contradicts a flag given is a ConfigError. An unreadable file is left for the training
    rules to report (validate(cfg, "train-gpt") names it); parsing alone does not need it."""
    path = values.get("deepspeed.config")
    if not values.get("deepspeed.enabled") or not path:
        return
    try:
        data = read_ds_json(str(path))
    except ConfigError:
        return
    values["deepspeed.config_json"] = data
    section = data.get("optimizer")
    if section is None:
        return
    for key, (value, json_key, flag) in json_optimizer_values(section, "").items():
        if key in values and values[key] != value:
            raise ConfigError(
                f"{json_key}={value!r} in the DeepSpeed JSON contradicts {flag} "
                f"({values[key]!r}). Fix: make them equal, or drop one of them"
            )
        values[key] = value


def read_ds_json(path: str) -> dict:
    """The DeepSpeed JSON at `path`, or a ConfigError naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed_config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed_config {path}: the top level must be a JSON object")
    return data


def with_ds_json(cfg: MegatronConfig) -> MegatronConfig:
    """`cfg` with the --deepspeed_config content in deepspeed.config_json (read here only when
    parsing did not: a config built in code, or a file missing then)."""
    d = cfg.deepspeed
    if not d.enabled or not d.config or d.config_json is not None:
        return cfg
    return cfg.replace(deepspeed=dataclasses.replace(d, config_json=read_ds_json(d.config)))


_DEEPSPEED_ONLY = (
    ("--zero-stage", "zero_stage"),
    ("--zero-reduce-scatter", "zero_reduce_scatter"),
    ("--zero-contigious-gradients", "zero_contigious_gradients"),
    ("--zero-reduce-bucket-size", "zero_reduce_bucket_size"),
    ("--zero-allgather-bucket-size", "zero_allgather_bucket_size"),
    ("--deepspeed-activation-checkpointing", "activation_checkpointing"),
)
# DeepSpeed activation-checkpointing options: they configure deepspeed.checkpointing.
DS_CHECKPOINTING = (
    ("--partition-activations", "partition_activations"),
    ("--checkpoint-in-cpu", "checkpoint_in_cpu"),
    ("--contigious-checkpointing", "contigious_checkpointing"),
    ("--synchronize-each-layer", "synchronize_each_layer"),
    ("--profile-backward", "profile_backward"),
)


def uses_deepspeed_checkpointing(cfg: MegatronConfig) -> bool:
    """--deepspeed recompute runs through deepspeed.checkpointing when asked for, explicitly or
    by one of its options; otherwise through our mpu checkpoint (as v1.x did)."""
    d = cfg.deepspeed
    return d.enabled and (
        d.activation_checkpointing or any(getattr(d, name) for _, name in DS_CHECKPOINTING)
    )


def validate_deepspeed_flags(cfg: MegatronConfig) -> None:
    d = cfg.deepspeed
    given = [f for f, n in _DEEPSPEED_ONLY + DS_CHECKPOINTING if getattr(d, n) not in (None, False)]
    if given and not d.enabled:
        fail(given[0], "a DeepSpeed setting, given without --deepspeed", "add --deepspeed")
    checkpointing = [f for f, n in DS_CHECKPOINTING if getattr(d, n)]
    if d.activation_checkpointing:
        checkpointing.append("--deepspeed-activation-checkpointing")
    if checkpointing and cfg.recompute.granularity != "full":
        fail(
            checkpointing[0],
            "configures activation checkpointing, which is off",
            "add --checkpoint-activations (--recompute-granularity full)",
        )
    if d.cpu_torch_adam and not d.cpu_optimizer:
        fail("--cpu_torch_adam", "chooses the CPU optimizer's kernel", "add --cpu-optimizer")


def _agree(section: dict, key: str, value, flag: str, where: str) -> None:
    """Fill section[key] with value, or fail if the JSON already says something else."""
    if key not in section or section[key] == "auto":
        section[key] = value
    elif section[key] != value:
        raise ConfigError(
            f"{where}{key}={section[key]!r} in the DeepSpeed JSON contradicts {flag} ({value!r}). "
            f"Fix: make them equal, or drop {key} from the JSON so the flag fills it."
        )


def _precision(ds: dict, cfg: MegatronConfig) -> None:
    p, o = cfg.precision, cfg.optimizer
    fp16, bf16 = ds.setdefault("fp16", {}), ds.setdefault("bf16", {})
    _agree(fp16, "enabled", p.fp16, "--fp16", "fp16.")
    _agree(bf16, "enabled", p.bf16, "--bf16", "bf16.")
    if p.fp16:
        _agree(fp16, "loss_scale", o.loss_scale or 0, "--loss-scale", "fp16.")
        _agree(
            fp16,
            "initial_scale_power",
            int(math.log2(o.initial_loss_scale)),
            "--initial-loss-scale",
            "fp16.",
        )
        _agree(fp16, "loss_scale_window", o.loss_scale_window, "--loss-scale-window", "fp16.")
        _agree(fp16, "hysteresis", o.hysteresis, "--hysteresis", "fp16.")
        _agree(fp16, "min_loss_scale", o.min_loss_scale, "--min-loss-scale", "fp16.")


def _zero(ds: dict, cfg: MegatronConfig) -> None:
    d = cfg.deepspeed
    zero = ds.setdefault("zero_optimization", {})
    for key, value in (
        ("stage", d.zero_stage),
        ("reduce_scatter", d.zero_reduce_scatter),
        ("contiguous_gradients", d.zero_contigious_gradients),
        ("reduce_bucket_size", d.zero_reduce_bucket_size),
        ("allgather_bucket_size", d.zero_allgather_bucket_size),
    ):
        if value is not None:  # a classic flag given on the command line wins
            zero[key] = value
    zero.setdefault("stage", 0)
    if d.cpu_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", **zero.get("offload_optimizer", {})}
        if d.cpu_torch_adam:  # torch's AdamW steps the offloaded states, not DeepSpeedCPUAdam
            ds["zero_force_ds_cpu_optimizer"] = False
    if zero["stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage={zero['stage']}: use 0, 1, 2 or 3")
    if zero.get("offload_optimizer") and zero["stage"] == 0:
        raise ConfigError("offload_optimizer needs ZeRO stage 1 or more. Fix: pass --zero-stage 1")
    if cfg.parallel.pipeline_model_parallel_size > 1 and zero["stage"] > 1:
        raise ConfigError(
            f"ZeRO stage {zero['stage']} with --pipeline-model-parallel-size "
            f"{cfg.parallel.pipeline_model_parallel_size}: DeepSpeed's pipeline engine does not "
            "support ZeRO-2/3 (their gradient partitioning conflicts with pipelined gradient "
            "accumulation). Fix: use --zero-stage 1 (or 0) with pipeline parallelism, or ZeRO-2/3 "
            "with --pipeline-model-parallel-size 1"
        )


def _activation_checkpointing(ds: dict, cfg: MegatronConfig) -> None:
    d = cfg.deepspeed
    if cfg.recompute.granularity != "full" or not uses_deepspeed_checkpointing(cfg):
        return  # our mpu checkpoint recomputes
    ac = ds.setdefault("activation_checkpointing", {})
    for key, value in (
        ("partition_activations", d.partition_activations),
        ("cpu_checkpointing", d.checkpoint_in_cpu),
        ("contiguous_memory_optimization", d.contigious_checkpointing),
        ("synchronize_checkpoint_boundary", d.synchronize_each_layer),
        ("profile", d.profile_backward),
    ):
        ac[key] = value or ac.get(key, False)
    ac["number_checkpoints"] = -(-cfg.model.num_layers // cfg.recompute.num_layers)


def _json_optimizer(ds: dict, cfg: MegatronConfig) -> None:
    """A JSON "optimizer" section (v1.x's ds_zero_stage_2_config.json has one) must agree with
    the flags (the command line parser filled the flags it did not give from it); our optimizer,
    built from the flags, then runs, so the section is removed."""
    if "optimizer" not in ds:
        return
    values = {
        "optimizer.optimizer": cfg.optimizer.optimizer,
        "optimizer.lr": cfg.optimizer.lr,
        "optimizer.adam_beta1": cfg.optimizer.adam_beta1,
        "optimizer.adam_beta2": cfg.optimizer.adam_beta2,
        "optimizer.adam_eps": cfg.optimizer.adam_eps,
        "optimizer.weight_decay": cfg.optimizer.weight_decay,
        "training.clip_grad": cfg.training.clip_grad,
    }
    for path, (value, key, flag) in json_optimizer_values(ds.pop("optimizer"), "").items():
        if values[path] != value:
            raise ConfigError(
                f"{key}={value!r} in the DeepSpeed JSON contradicts {flag} ({values[path]!r}). "
                f"Fix: make them equal, or drop {key} from the JSON"
            )


def _sequence_parallel(ds: dict, cfg: MegatronConfig) -> None:
    """--sequence-parallel: TP ranks hold different tokens, so nothing DeepSpeed splits over TP
    on the assumption that TP ranks hold equal activations may stay on."""
    if not cfg.parallel.sequence_parallel:
        return
    fix = "Fix: drop it, or drop --sequence-parallel"
    if ds["zero_optimization"]["stage"] == 3:
        raise ConfigError(
            "--sequence-parallel with ZeRO stage 3: its partitioned norm weights are gathered "
            "and released inside forward, so their gradients (from s / TP tokens per rank) "
            "cannot be summed over TP first. Fix: use --zero-stage 0, 1 or 2 with "
            "--sequence-parallel, or drop --sequence-parallel"
        )
    if ds.get("activation_checkpointing", {}).get("partition_activations"):
        raise ConfigError(
            "--partition-activations (activation_checkpointing.partition_activations) with "
            "--sequence-parallel: it keeps 1/TP of each checkpoint and rebuilds it from the TP "
            f"peers, which hold other tokens under sequence parallelism. {fix}"
        )
    pipe = ds.setdefault("pipeline", {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipe.get(key):
            raise ConfigError(
                f"pipeline.{key} in the DeepSpeed JSON with --sequence-parallel: DeepSpeed sends "
                "1/TP of each stage's activations (gradients) and rebuilds them from the TP "
                f"peers, which hold other tokens under sequence parallelism. {fix}"
            )
        pipe[key] = False  # DeepSpeed's default is True


def _experts(ds: dict, cfg: MegatronConfig) -> None:
    """MoE (--num-experts) under DeepSpeed: ZeRO 0-2 without its pipeline engine, with the
    ZeRO options DeepSpeed's MoE gradient path needs (megatron/training/deepspeed/moe.py)."""
    if not cfg.model.moe:
        return
    zero, why = ds["zero_optimization"], None
    if zero["stage"] == 3:
        why = (
            "ZeRO stage 3: DeepSpeed does not support MoE with ZeRO-3 (its engine refuses "
            "'Native DeepSpeed MoE is not supported with ZeRO Stage 3'). Fix: use --zero-stage "
            "0, 1 or 2, or drop --deepspeed (our --use-distributed-optimizer shards experts)"
        )
    elif cfg.parallel.expert_tp_size > 1:
        why = (
            f"--expert-tensor-parallel-size {cfg.parallel.expert_tp_size}: DeepSpeed's MoE "
            "path keeps whole experts on each TP rank (Megatron-DeepSpeed's default); its "
            "gradient norm and ZeRO partitions know no expert-tensor-parallel group. Fix: drop "
            "the flag (1 under --deepspeed) or drop --deepspeed"
        )
    elif cfg.parallel.pipeline_model_parallel_size > 1:
        why = (
            f"--pipeline-model-parallel-size {cfg.parallel.pipeline_model_parallel_size}: "
            "DeepSpeed's pipeline engine is not given our expert groups (it would average "
            "expert gradients over all of DP) nor the aux losses' gradient scale. Fix: use "
            "--pipeline-model-parallel-size 1 with --deepspeed, or drop --deepspeed (our "
            "pipeline runs MoE)"
        )
    elif cfg.parallel.expert_model_parallel_size > 1 and zero["stage"] == 0:
        if cfg.precision.fp16 or cfg.precision.bf16:
            why = (
                "ZeRO stage 0 in fp16/bf16 with --expert-model-parallel-size > 1: DeepSpeed's "
                "(unfused) fp16/bf16 optimizer leaves the expert gradients out of the gradient "
                "norm, so clipping and the logged norm would ignore them. Fix: use --zero-stage "
                "1 or 2 (or fp32 at stage 0)"
            )
    elif cfg.parallel.expert_model_parallel_size > 1:
        if not zero.get("reduce_scatter", True):
            why = (
                "zero_optimization.reduce_scatter=false: DeepSpeed reduces expert gradients "
                "over the expert-data-parallel group only on its reduce-scatter path. Fix: drop "
                "it (or pass --zero-reduce-scatter)"
            )
        elif zero["stage"] == 2 and not zero.get("contiguous_gradients", True):
            why = (
                "zero_optimization.contiguous_gradients=false with ZeRO-2: DeepSpeed's MoE "
                "support needs contiguous gradients. Fix: drop it (or pass "
                "--zero-contigious-gradients)"
            )
    if why:
        raise ConfigError(f"--num-experts with --deepspeed and {why}")


def build_ds_config(cfg: MegatronConfig) -> dict:
    """The JSON of --deepspeed_config, completed and checked against the command line."""
    ds = copy.deepcopy(with_ds_json(cfg).deepspeed.config_json or {})
    _json_optimizer(ds, cfg)
    for section, flags in (("scheduler", "--lr-decay-style/--lr-warmup-*/--min-lr"),):
        if section in ds:
            raise ConfigError(
                f"'{section}' in the DeepSpeed JSON: the optimizer and the LR schedule come from "
                f"{flags}, so the two can never disagree. Fix: remove '{section}' from the JSON"
            )
    t, dp = cfg.training, cfg.parallel.data_parallel_size
    gbs = t.resolved_global_batch_size(dp)
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage: DeepSpeed's pipeline engine "
            "has no interleaved schedule. Fix: drop the flag, or train without "
            "--deepspeed (our pipeline schedules support it)"
        )
    m = cfg.model
    shared = m.num_unique_layers is not None and m.num_unique_layers < m.num_layers
    if shared and cfg.parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "--num-unique-layers: DeepSpeed's pipeline engine builds one module per layer and "
            "cannot share a layer's weights between layers. Fix: train without --deepspeed "
            "(our pipeline shares them), or with --pipeline-model-parallel-size 1"
        )
    if t.rampup_batch_size is not None:
        raise ConfigError(
            "--rampup-batch-size is not supported with --deepspeed (its batch "
            "size is fixed in the JSON). Fix: drop one of them"
        )
    _agree(ds, "train_micro_batch_size_per_gpu", t.micro_batch_size, "--micro-batch-size", "")
    # The same split into micro batches as the loop's (the ramp is refused above).
    micro_batches = gbs // (t.micro_batch_size * dp)
    gas = t.gradient_accumulation_steps is not None and t.global_batch_size is None
    _agree(
        ds,
        "gradient_accumulation_steps",
        micro_batches,
        "--gas" if gas else "--global-batch-size / (--micro-batch-size x DP)",
        "",
    )
    batch_flag = "--gas x --micro-batch-size x DP" if gas else "--global-batch-size"
    _agree(ds, "train_batch_size", gbs, batch_flag, "")
    _agree(ds, "gradient_clipping", t.clip_grad, "--clip-grad", "")
    _precision(ds, cfg)
    _zero(ds, cfg)
    _activation_checkpointing(ds, cfg)
    _sequence_parallel(ds, cfg)
    _experts(ds, cfg)
    if cfg.model.mtp_num_layers and ds["zero_optimization"]["stage"] == 3:
        raise ConfigError(
            "--mtp-num-layers with ZeRO stage 3: the multi-token prediction depths project "
            "through the output head's weight after the head's own forward, when ZeRO-3 has "
            "released it. Fix: use --zero-stage 0, 1 or 2, or drop --mtp-num-layers"
        )
    ds.setdefault("steps_per_print", 10**9)  # we log; DeepSpeed stays quiet
    ds.setdefault("wall_clock_breakdown", False)
    return ds

"""The sections of the config tree that describe a training run: loop, optimizer and learning-
rate schedule, checkpoints, logging, DeepSpeed. Part of megatron.config.schema (import them from
there); declared the same way, with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting
from megatron.config.optimizers import NAMES as OPTIMIZER_NAMES
from megatron.config.schema_resilience import StragglerSettings

LR_DECAY_STYLES = ("constant", "linear", "cosine", "exponential", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class TrainingConfig(Section):
    """The training loop: batch sizes, length, evaluation and exit conditions."""

    seed: int = setting(1234, "base random seed")
    micro_batch_size: int = setting(
        1, "samples per forward pass on one data-parallel rank", "--batch-size", min=1
    )
    global_batch_size: int | None = setting(
        None,
        "samples per optimizer step over all data-parallel ranks "
        "(default micro-batch-size x DP; the rest is gradient accumulation)",
    )
    gradient_accumulation_steps: int | None = setting(
        None,
        "micro batches per step on each data-parallel rank (v1.x --gas): global batch = "
        "micro-batch-size x DP x this; must agree with --global-batch-size if both are given",
        "--gas",
        min=1,
    )
    rampup_batch_size: tuple[int, int, int] | None = setting(
        None,
        "grow the global batch from START by INCREMENT over SAMPLES samples "
        "(needs --train-samples)",
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    train_iters: int | None = setting(None, "optimizer steps to train", min=1)
    train_samples: int | None = setting(
        None, "samples to train (instead of --train-iters; schedules count samples)", min=1
    )
    eval_interval: int = setting(1000, "iterations between validation runs", min=1)
    eval_iters: int = setting(100, "batches per validation run (0 disables validation)", min=0)
    exit_interval: int | None = setting(
        None, "save and exit when the iteration is a multiple of this", min=1
    )
    exit_duration_in_mins: float | None = setting(
        None, "save and exit after this many minutes of training", above=0
    )
    exit_signal_handler: bool = setting(
        False, "on SIGTERM: all ranks agree, save a checkpoint and exit 0"
    )
    clip_grad: float = setting(1.0, "clip the global gradient norm to this (0 disables)", min=0)
    max_skipped_in_a_row: int = setting(
        50, "stop with an error after this many consecutive skipped steps (overflow/NaN)", min=1
    )
    num_workers: int = setting(2, "DataLoader worker processes per rank", min=0)

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        if self.global_batch_size:
            return self.global_batch_size
        return self.micro_batch_size * data_parallel_size * (self.gradient_accumulation_steps or 1)


_MUON = ("optimizer", "muon")  # the Muon settings mean something to --optimizer muon only


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """Optimizer, learning-rate schedule and fp16 loss scaling (Megatron's flag names)."""

    optimizer: str = setting(
        "adam",
        "adam = AdamW (decoupled weight decay), sgd with momentum, or muon (the transformer "
        "layers' matrices take Muon, embeddings, output head, norms and biases AdamW with "
        "--lr and the --adam-* flags; docs/configuration.md)",
        choices=OPTIMIZER_NAMES,
    )
    lr: float | None = setting(None, "peak learning rate (required)", above=0)
    min_lr: float = setting(0.0, "floor of the decay", min=0)
    weight_decay: float = setting(0.01, "decoupled weight decay; never applied to biases and norms")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.999, "Adam beta2")
    adam_eps: float = setting(1e-8, "Adam epsilon")
    sgd_momentum: float = setting(0.9, "SGD momentum")
    muon_momentum: float = setting(
        0.95,
        "Muon: momentum (EMA of the gradients that Newton-Schulz orthogonalises)",
        min=0,
        below=1,
        requires=_MUON,
    )
    muon_nesterov: bool = setting(
        True,
        "Muon: Nesterov momentum (orthogonalise (1 - mu) g + mu B instead of B)",
        shortcuts={
            "--muon-nesterov": (True, "Megatron-core's spelling: Nesterov on (the default)"),
            "--muon-use-nesterov": (True, "older Megatron / MindSpeed spelling of --muon-nesterov"),
        },
        requires=_MUON,
    )
    muon_num_ns_steps: int = setting(
        5,
        "Muon: quintic Newton-Schulz iterations per update",
        "--muon-ns-steps",
        min=1,
        max=99,
        requires=_MUON,
    )
    muon_scale_mode: str = setting(
        "spectral",
        "Muon: update scale by the matrix's A x B shape: spectral sqrt(max(A, B)), "
        "unit_rms_norm sqrt(A / B), shape_scaling sqrt(max(1, A / B)); times "
        "--muon-extra-scale-factor",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
        requires=_MUON,
    )
    muon_extra_scale_factor: float = setting(
        0.2,
        "Muon: multiplies the update scale; 0.2 with spectral is Moonlight's rule, which gives "
        "Muon's update AdamW's RMS so one --lr serves both (Megatron-core's default is 1.0)",
        above=0,
        requires=_MUON,
    )
    muon_split_qkv: bool = setting(
        True,
        "Muon: orthogonalise Q, K and V of the fused query_key_value weight (and, beyond "
        "Megatron-core's flag, SwiGLU's gate and up) as separate matrices",
        flag="--muon-no-split-qkv",
        requires=_MUON,
    )
    lr_decay_style: str = setting(
        "linear",
        "decay after warmup (exponential: Megatron-LM v1.x's, halving over the decay)",
        choices=LR_DECAY_STYLES,
    )
    lr_decay_iters: int | None = setting(
        None, "iterations to decay over (default --train-iters)", min=1
    )
    lr_decay_samples: int | None = setting(
        None, "samples to decay over (default --train-samples)", min=1
    )
    lr_warmup_init: float = setting(
        0.0,
        "lr of the first update when warming up (Megatron-LM's flag; the warmup runs linearly "
        "from it to --lr, and the first update uses it: 0 by default, as in Megatron-LM)",
        min=0,
    )
    lr_warmup_iters: int = setting(0, "linear warmup iterations", min=0)
    lr_warmup_samples: int = setting(0, "linear warmup samples", min=0)
    lr_warmup_fraction: float | None = setting(
        None, "warmup as a fraction of the decay length", min=0, below=1
    )
    warmup: float | None = setting(None, "classic spelling of --lr-warmup-fraction", min=0, below=1)
    lr_wsd_decay_style: str = setting(
        "exponential",
        "WSD: shape of the final annealing phase",
        choices=LR_WSD_DECAY_STYLES,
    )
    lr_wsd_decay_iters: int | None = setting(None, "WSD: iterations of the final annealing phase")
    lr_wsd_decay_samples: int | None = setting(None, "WSD: samples of the final annealing phase")
    override_lr_scheduler: bool = setting(
        False, "on resume, use these flags' schedule (keep only the step count)"
    )
    use_checkpoint_lr_scheduler: bool = setting(False, "on resume, use the checkpoint's schedule")
    loss_scale: float | None = setting(None, "fp16: static loss scale (default: dynamic)", above=0)
    initial_loss_scale: float = setting(2.0**32, "fp16: first dynamic scale")
    min_loss_scale: float = setting(
        1.0, "fp16: the dynamic scale never goes below this", "--min-scale", above=0
    )
    loss_scale_window: int = setting(
        1000, "fp16: steps without overflow before the scale doubles", min=1
    )
    hysteresis: int = setting(2, "fp16: overflows tolerated before the scale is halved", min=1)
    use_distributed_optimizer: bool = setting(
        False,
        "shard the fp32 main weights and optimizer moments over the data-parallel ranks "
        "(ZeRO-1): gradients are reduce-scattered, each rank updates its shard, the weights "
        "are all-gathered",
    )
    overlap_param_gather: bool = setting(
        False,
        "with --use-distributed-optimizer: all-gather the updated weights bucket by bucket "
        "during the next forward instead of right after the step",
    )


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Saving and resuming (beside the checkpoints: run_config.yaml, this run's config)."""

    save: str | None = setting(None, "directory to save checkpoints in")
    load: str | None = setting(None, "directory to resume from")
    save_interval: int | None = setting(None, "iterations between saves", min=1)
    no_load_optim: bool = setting(False, "do not load optimizer state")
    no_load_rng: bool = setting(False, "do not load RNG states")
    no_save_optim: bool = setting(
        False,
        "save weights without optimizer and LR-schedule state (resuming then needs "
        "--no-load-optim or --finetune)",
    )
    no_save_rng: bool = setting(
        False, "save without RNG states (resuming then needs --no-load-rng or --finetune)"
    )
    finetune: bool = setting(False, "load weights only and start from iteration 0")
    save_retain_last: int | None = setting(None, "keep only the newest K complete checkpoints")
    async_save: bool = setting(
        False,
        "write checkpoints on a background thread (Megatron-core's flag): training waits only "
        "for a host copy of the state; the same files, marker and pointer as a synchronous "
        "save, committed at a later step (at most one save in flight; exit waits for it)",
    )


@dataclass(frozen=True)
class _LoggingFields(Section):
    """The logging fields of LoggingConfig (declared first, so they lead in --help)."""

    log_interval: int = setting(100, "iterations between log lines", min=1)
    tensorboard_dir: str | None = setting(None, "write TensorBoard scalars here")
    timing_log_level: int = setting(
        0,
        "0: iteration time (no device sync); 1: + forward/backward/optimizer; 2: everything "
        "(1 and 2 synchronize the device around each timed phase)",
        choices=(0, 1, 2),
    )
    peak_tflops: float | None = setting(
        None, "peak TFLOP/s of one device, for MFU (default: known GPUs)"
    )
    profile: bool = setting(
        False,
        "trace iterations --profile-step-start+1 .. --profile-step-end with the torch profiler "
        "(Chrome/TensorBoard trace per rank); on CUDA also NVTX ranges and "
        "cudaProfilerStart/Stop around the window (nsys --capture-range=cudaProfilerApi)",
    )
    profile_step_start: int = setting(
        10, "--profile: the window opens after this many iterations (Megatron-core's count)", min=0
    )
    profile_step_end: int = setting(
        12, "--profile: the window closes after this iteration (records end - start steps)"
    )
    profile_ranks: tuple[int, ...] = setting(
        (0,), "--profile: global ranks that record a trace (space separated)"
    )
    profile_dir: str | None = setting(
        None,
        "--profile: where the traces go (default: --tensorboard-dir, so TensorBoard's profiler "
        "plugin finds them, else ./profile)",
    )
    wandb_project: str | None = setting(
        None,
        "send the TensorBoard scalars and the resolved config to this W&B project (needs wandb)",
    )
    wandb_exp_name: str | None = setting(None, "W&B run name (default: W&B picks one)")
    wandb_save_dir: str | None = setting(
        None, "W&B's local files (default: SAVE/wandb with --save, else ./wandb)"
    )


@dataclass(frozen=True)
class LoggingConfig(StragglerSettings, _LoggingFields):
    """Log lines, timers, TensorBoard, Weights & Biases and the profiler.

    The straggler detector's fields (--log-straggler, ...) follow, declared in
    megatron.config.schema_resilience."""


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

"""Flags of the training run: loop, optimizer, learning-rate schedule, loss scaling, checkpoints,
logging. Each flag's dest equals its config field, so the groups are filled by name."""

from __future__ import annotations

import argparse
import dataclasses

from megatron.config.schema import CheckpointConfig, DeepSpeedConfig, LoggingConfig, OptimizerConfig


def fill(cls, ns: argparse.Namespace, **overrides):
    """Build dataclass `cls` from the namespace attributes named like its fields."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


def add_loop_args(g) -> None:
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES samples "
        "(needs --train-samples)",
    )
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps to train")
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="samples to train (instead of --train-iters; schedules count samples)",
    )
    g.add_argument(
        "--eval-interval", type=int, default=1000, help="iterations between validation runs (1000)"
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="batches per validation run (100; 0 disables validation)",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save and exit when the iteration is a multiple of this",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save and exit after this many minutes of training",
    )
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM: all ranks agree, save a checkpoint and exit 0",
    )
    g.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (1.0; 0 disables)",
    )
    g.add_argument(
        "--max-skipped-in-a-row",
        type=int,
        default=50,
        help="stop with an error after this many consecutive skipped steps (overflow/NaN) (50)",
    )
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank (2)")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer")
    g.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="adam = AdamW (decoupled weight decay), or sgd with momentum",
    )
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (required)")
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="decoupled weight decay (0.01); never applied to biases and norms",
    )
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (0.9)")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2 (0.999)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (1e-8)")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum (0.9)")


def _add_lr_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--min-lr", type=float, default=0.0, help="floor of the decay (0)")
    g.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="decay after warmup (linear)",
    )
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iterations to decay over (default --train-iters)",
    )
    g.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="samples to decay over (default --train-samples)",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup iterations")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="linear warmup samples")
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warmup as a fraction of the decay length",
    )
    g.add_argument(
        "--warmup", type=float, default=None, help="classic spelling of --lr-warmup-fraction"
    )
    g.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["linear", "cosine", "exponential", "minus_sqrt"],
        help="WSD: shape of the final annealing phase (exponential)",
    )
    g.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="WSD: iterations of the final annealing phase",
    )
    g.add_argument(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="WSD: samples of the final annealing phase",
    )
    g.add_argument(
        "--override-lr-scheduler",
        action="store_true",
        help="on resume, use these flags' schedule (keep only the step count)",
    )
    g.add_argument(
        "--use-checkpoint-lr-scheduler",
        action="store_true",
        help="on resume, use the checkpoint's schedule",
    )


def _add_loss_scale_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fp16 loss scaling")
    g.add_argument(
        "--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)"
    )
    g.add_argument(
        "--initial-loss-scale", type=float, default=2.0**32, help="first dynamic scale (2^32)"
    )
    g.add_argument(
        "--min-loss-scale", type=float, default=1.0, help="dynamic scale never goes below this (1)"
    )
    g.add_argument(
        "--loss-scale-window",
        type=int,
        default=1000,
        help="steps without overflow before the scale doubles (1000)",
    )
    g.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="overflows tolerated before the scale is halved (2)",
    )


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints in")
    g.add_argument("--load", default=None, help="directory to resume from")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument(
        "--finetune", action="store_true", help="load weights only and start from iteration 0"
    )
    g.add_argument(
        "--save-retain-last",
        type=int,
        default=None,
        help="keep only the newest K complete checkpoints",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-interval", type=int, default=100, help="iterations between log lines (100)"
    )
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument(
        "--timing-log-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="0: iteration time; 1: + forward/backward/optimizer; 2: everything",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s of one device, for MFU (default: known GPUs)",
    )


def _add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("deepspeed", "hand ZeRO, pipeline and recompute to DeepSpeed")
    # The names deepspeed.add_config_arguments defines, without importing deepspeed to parse.
    g.add_argument(
        "--deepspeed",
        action="store_true",
        dest="enabled",
        help="train through DeepSpeed (pip install --no-build-isolation deepspeed)",
    )
    g.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="config",
        default=None,
        help="DeepSpeed JSON; filled from these flags where it is silent",
    )
    g.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="ZeRO stage (overrides the JSON)",
    )
    g.add_argument(
        "--zero-reduce-scatter",
        action="store_true",
        default=None,
        help="ZeRO: reduce-scatter gradients (overrides the JSON)",
    )
    g.add_argument(
        "--zero-contigious-gradients",
        action="store_true",
        default=None,
        help="ZeRO: copy gradients to a contiguous buffer (overrides the JSON)",
    )
    g.add_argument(
        "--zero-reduce-bucket-size",
        type=int,
        default=None,
        help="ZeRO: elements per reduce bucket (overrides the JSON)",
    )
    g.add_argument(
        "--zero-allgather-bucket-size",
        type=int,
        default=None,
        help="ZeRO: elements per all-gather bucket (overrides the JSON)",
    )
    g.add_argument(
        "--cpu-optimizer",
        action="store_true",
        help="ZeRO: keep optimizer states on the CPU (offload_optimizer)",
    )
    g.add_argument(
        "--partition-activations",
        action="store_true",
        help="DeepSpeed recompute: split checkpointed activations over TP ranks",
    )
    g.add_argument(
        "--checkpoint-in-cpu",
        action="store_true",
        help="DeepSpeed recompute: keep checkpointed activations on the CPU",
    )
    g.add_argument(
        "--contigious-checkpointing",
        action="store_true",
        help="DeepSpeed recompute: copy checkpoints into one buffer",
    )
    g.add_argument(
        "--synchronize-each-layer",
        action="store_true",
        help="DeepSpeed recompute: synchronize the device after each layer",
    )
    g.add_argument(
        "--profile-backward",
        action="store_true",
        help="DeepSpeed recompute: time the backward of each layer",
    )


def add_training_run_args(parser: argparse.ArgumentParser) -> None:
    _add_deepspeed_args(parser)
    _add_optimizer_args(parser)
    _add_lr_args(parser)
    _add_loss_scale_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)


def training_run_groups(ns: argparse.Namespace) -> dict:
    return {
        "optimizer": fill(OptimizerConfig, ns),
        "checkpoint": fill(CheckpointConfig, ns),
        "logging": fill(LoggingConfig, ns),
        "deepspeed": fill(DeepSpeedConfig, ns),
    }

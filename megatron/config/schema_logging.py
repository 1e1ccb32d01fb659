"""The logging section of the config tree (`logging.*`): log lines, timers, TensorBoard, Weights &
Biases, the profiler and the straggler detector. Part of megatron.config.schema (import them
from there); declared the same way, with `setting(default, help, *aliases, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.declare import Section, setting


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
class StragglerSettings(Section):
    """The straggler detector (--log-straggler, megatron/resilience/straggler.py)."""

    log_straggler: bool = setting(
        False,
        "every --log-interval, gather each rank's forward/backward/optimizer/data/communication "
        "times (one all-gather of a few floats) and log the slowest ranks, their host and how "
        "much slower than the median they are; TensorBoard/W&B get the spread",
    )
    straggler_minmax_count: int = setting(
        1, "--log-straggler: how many of the slowest (and fastest) ranks the report names", min=1
    )
    straggler_ctrlr_port: int = setting(
        65535,
        "--log-straggler: rank 0 listens on this TCP port; any connection (curl HOST:PORT) "
        "toggles the detector on/off at the next log line",
        min=1,
        max=65535,
    )
    disable_straggler_on_startup: bool = setting(
        False,
        "--log-straggler: start with the detector off (turn it on through --straggler-ctrlr-port)",
    )


@dataclass(frozen=True)
class LoggingConfig(StragglerSettings, _LoggingFields):
    """Log lines, timers, TensorBoard, Weights & Biases and the profiler.

    The straggler detector's fields (--log-straggler, ...) follow the others."""

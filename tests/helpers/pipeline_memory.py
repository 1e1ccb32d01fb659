"""Each pipeline stage's peak activation bytes over a real training step, next to the
planner's model of it (tests/planning/test_pipeline_memory.py and bench/pipeline.py).

Measured: one step of pretrain() on gloo CPU ranks (the tiny GPT of tests/helpers/training
through the real model and the schedule executor, megatron.training.pipeline), the whole step
inside megatron.model.memory.LiveActivations: the peak over the step of the bytes autograd
holds for backward plus what the zero-bubble weight-gradient queue holds between B and W, each
storage once. Planned: megatron.planning.pipeline_memory.stage_activation_peak's
`activations` term for the same layout (its `p2p_buffers` and `recompute_working` terms are
what the measurement leaves out).
"""

from __future__ import annotations

import dataclasses

from megatron.config.cli import parse_args
from megatron.model.memory import LiveActivations
from megatron.models.gpt.train import forward_step
from megatron.planning.enumerate import training_of
from megatron.planning.memory import Device, Layout
from megatron.planning.pipeline_memory import stage_activation_peak
from megatron.schedules.registry import V_SHAPED
from tests.helpers.training import flags, train_run

# (schedule, extra flags): chunks of one layer for interleaved (8 layers: V = 8 / P).
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


def case_flags(data_prefix: str, schedule: str, pp: int, *extra: str) -> list[str]:
    """One step of an 8-layer, 32-wide GPT, 16 samples of 2 (DualPipeV needs M >= 2 P), at
    PP `pp` under `schedule` (interleaved: two chunks per stage)."""
    argv = flags(data_prefix, "--num-layers", "8", iters=1)
    argv[argv.index("--global-batch-size") + 1] = "16"
    argv += ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule]
    if schedule == "interleaved":
        argv += ["--num-layers-per-virtual-pipeline-stage", str(8 // (2 * pp))]
    return [*argv, *extra]


def measure_peaks(rank: int, world: int, cases: list[list[str]]) -> list[tuple[int, int]]:
    """Per case (a flag list): (this rank's pipeline stage, its peak activation bytes)."""
    out = []
    for argv in cases:
        live = LiveActivations()
        seen: set[int] = set()

        def step(data_iterator, chunk, live=live, seen=seen):
            if id(chunk) not in seen:  # its weights (and their detached views) are no activation
                seen.add(id(chunk))
                live.exclude(chunk.parameters())
            live.watch(chunk)  # the zero-bubble queue of this step's weight-gradient split
            return forward_step(data_iterator, chunk)

        with live:
            result = train_run(rank, world, argv, hook=step)
        out.append((result.model.module.chunks[0].state.pp_rank, live.peak))
    return out


def planned_peak(argv: list[str], world: int, stage: int) -> int:
    """The planner's `activations` term for stage `stage` of the run `argv` describes."""
    cfg = parse_args(argv, world_size=world)
    par, t, m = cfg.parallel, cfg.training, cfg.model
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    schedule = par.resolved_pipeline_schedule
    vp = 2 if schedule in V_SHAPED or schedule == "interleaved" else None
    lay = Layout(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        dp=dp,
        micro_batch=t.micro_batch_size,
        num_micro_batches=t.global_batch_size // (t.micro_batch_size * dp),
        vp=vp,
        recompute=cfg.recompute.granularity,
        sequence_parallel=par.sequence_parallel,
        schedule=schedule,
    )
    # CPU: dropout masks in the activation dtype; SDPA's flash kernel without attention dropout
    dev = Device(mask_bytes=4, flash_attention=m.attention_dropout == 0)
    training = dataclasses.replace(training_of(cfg))
    return stage_activation_peak(m, lay, training, dev, stage)["activations"]

"""--auto-parallel: replace the layout settings by the planner's top plan for the world size.

The settings the planner chooses are TP, CP, PP, virtual stages, --sequence-parallel, the
micro batch and recompute. Those given away from their defaults (TP, CP or PP > 1, a micro
batch other than 1, a recompute granularity, --sequence-parallel) are kept as constraints of
the search.
The returned config has auto_parallel off, so the run config it writes reruns the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron.config.declare import ConfigError
from megatron.config.schema import MegatronConfig
from megatron.planning.enumerate import Plan, Search, best_plan, candidate
from megatron.planning.memory import Device, GiB
from megatron.planning.timing import Hardware
from megatron.schedules.registry import is_default


def _gpu_memory_gb(cfg: MegatronConfig) -> float:
    given = cfg.parallel.auto_parallel_gpu_memory_gb
    if given is not None:
        return given
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    raise ConfigError(
        "--auto-parallel-gpu-memory-gb: no CUDA device to read the memory of. "
        "Fix: pass --auto-parallel-gpu-memory-gb GIB (e.g. 80 for an A100-80GB)"
    )


def search_for(cfg: MegatronConfig) -> Search:
    """The search --auto-parallel runs: the flags given away from their defaults are fixed."""
    par, t, r = cfg.parallel, cfg.training, cfg.recompute
    hw = Hardware(gpus_per_node=par.auto_parallel_gpus_per_node)
    if cfg.logging.peak_tflops:
        hw = dataclasses.replace(hw, peak_tflops=cfg.logging.peak_tflops)
    overhead = int(par.auto_parallel_overhead_gb * GiB)
    return Search(
        world_size=par.world_size,
        gpu_memory_gb=_gpu_memory_gb(cfg),
        hardware=hw,
        device=Device(overhead_bytes=overhead),
        micro_batches=(t.micro_batch_size,) if t.micro_batch_size != 1 else None,
        recompute=(r.granularity,) if r.granularity else (None, "selective", "full"),
        sequence_parallel=(True,) if par.sequence_parallel else (False, True),
        interleave=par.num_layers_per_virtual_pipeline_stage is None
        and (par.pipeline_schedule is None or par.schedule.chunks is None),
        tensor_parallel=(par.tensor_model_parallel_size,)
        if par.tensor_model_parallel_size > 1
        else None,
        pipeline_parallel=(par.pipeline_model_parallel_size,)
        if par.pipeline_model_parallel_size > 1
        else None,
        context_parallel=(par.context_parallel_size,) if par.context_parallel_size > 1 else None,
        expert_tensor_parallel=1 if par.expert_tensor_parallel_size == 1 else None,
        memory_flag="--auto-parallel-gpu-memory-gb",
        **given_schedule(cfg),
    )


def given_schedule(cfg: MegatronConfig) -> dict:
    """The Search fields of a --pipeline-schedule given other than the defaults (a zero-bubble
    one): that schedule only (at PP > 1). 1F1B / interleaved given stay on every candidate
    (megatron.planning.enumerate.candidate), which the rules then hold to their chunks."""
    schedule = cfg.parallel.pipeline_schedule
    if schedule is None or is_default(schedule):
        return {}
    return {"schedules": (schedule,), "only_schedules": True}


def describe_plan(p: Plan) -> str:
    terms = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in p.time.items() if v)
    return (
        f"{p.layout.describe()}: {p.memory.total / GiB:.2f} GiB/GPU (stage {p.memory.stage}), "
        f"step {p.step_s * 1e3:.1f} ms, MFU {p.mfu * 100:.1f}%, limit {p.limit} [{terms}]"
    )


def auto_parallel(
    cfg: MegatronConfig, *, vocab_size: int | None = None, log: Callable[[str], None] = print
) -> MegatronConfig:
    """The config with the top plan's layout (unchanged without --auto-parallel)."""
    if not cfg.parallel.auto_parallel:
        return cfg
    model = cfg.model
    if model.vocab_size is None:
        if vocab_size is None:
            raise ConfigError(
                "--auto-parallel: the vocabulary size is unknown. "
                "Fix: pass --vocab-size or a tokenizer"
            )
        model = dataclasses.replace(model, vocab_size=vocab_size)
    search = search_for(cfg)
    best, ranked = best_plan(cfg.replace(model=model), search)
    fitting = [p for p in ranked if p.fits]
    log(
        f"auto-parallel: {len(ranked)} valid layouts of {search.world_size} GPUs, "
        f"{len(fitting)} fit in {search.gpu_memory_gb:g} GiB; chose {describe_plan(best)}"
    )
    for p in fitting[1:3]:
        log(f"auto-parallel: next {describe_plan(p)}")
    chosen = candidate(cfg, search.world_size, best.layout)
    return chosen.replace(parallel=dataclasses.replace(chosen.parallel, auto_parallel=False))

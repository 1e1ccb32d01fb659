"""What every kernel module shares: Triton if it is installed, the input check, autotuning.

The modules import without Triton (their torch references still work); calling a kernel then
raises a clear error.
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton, tl = None, None

HAS_TRITON = triton is not None
jit = triton.jit if HAS_TRITON else (lambda fn: fn)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Read when the kernels are defined, as triton.jit reads it: they run in the CPU interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# MEGATRON_KERNEL_AUTOTUNE=0: each row width gets one fixed config instead of the fastest of
# several timed on the first call. Timing can pick differently on different ranks, and the
# configs sum a row in different orders (last-bit differences): with tensor parallelism and no
# sequence parallelism the replicated norm weights are updated on each rank from its own sums.
_AUTOTUNE_ENV = os.environ.get("MEGATRON_KERNEL_AUTOTUNE", "1") != "0"
AUTOTUNE = _AUTOTUNE_ENV


def fix_configs(fixed: bool = True) -> None:
    """One config per row width for the run being built (as MEGATRON_KERNEL_AUTOTUNE=0), or,
    `fixed=False`, the environment's choice again: the trainer fixes them under tensor
    parallelism, so every TP rank sums its rows in the same order, and a later run in the same
    process gets autotuning back. Read when a kernel first meets a width (the autotuner's
    prune), so it must run before that."""
    global AUTOTUNE
    AUTOTUNE = _AUTOTUNE_ENV and not fixed


def check_kernel_input(t: torch.Tensor, what: str, fallback: str) -> None:
    """Triton present and `t` in a dtype the kernels take; `fallback` names the torch twin."""
    if not HAS_TRITON:
        raise RuntimeError(f"Triton is not installed; use {fallback}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{what} take fp32/bf16/fp16 inputs, got {t.dtype}")


def config(num_warps: int, **meta: int):
    """A triton.Config of constexpr meta-parameters (None without Triton)."""
    return triton.Config(meta, num_warps=num_warps) if HAS_TRITON else None


def _quick_bench(kernel_call, quantiles):
    # The autotuner's default spends 125 ms per config; these kernels run for tens of us.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def autotune(configs, interpret_config, key, prune=None):
    """triton.autotune over `configs` (after `prune(configs, named_args, **kwargs)`), keyed on the
    argument names `key` (and the tensors' dtypes): the first call of each key on a GPU times the
    candidates and keeps the fastest. Under TRITON_INTERPRET=1 the single `interpret_config`
    runs: timing the CPU interpreter would take minutes and pick nothing meaningful.

    The kernels it wraps must be idempotent (outputs only written, never accumulated), as
    timing runs them repeatedly on the caller's tensors."""
    if not HAS_TRITON:
        return lambda fn: fn
    if INTERPRET:
        tuner = triton.autotune([interpret_config], key=key)
    else:
        kw = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}
        if "do_bench" in inspect.signature(triton.autotune).parameters:
            kw["do_bench"] = _quick_bench
        tuner = triton.autotune(configs, key=key, **kw)

    def decorate(fn):
        tuned = tuner(fn)
        # What a GPU picks from, kept in both modes so that CPU tests can check the pruning.
        tuned.gpu_configs, tuned.gpu_prune = configs, prune
        return tuned

    return decorate


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def reduction_programs(device: torch.device, per_sm: int = 1) -> int:
    """How many programs a kernel that keeps per-program partial sums launches: a few per SM on
    a GPU (each program loops over a chunk of rows), 4 in the interpreter (so tests see several
    ragged chunks)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return per_sm * _sm_count(index)


def bounded_configs(configs, tile_elements, per_thread=(4, 32)):
    """The configs whose tile (`tile_elements(config)` values) gives each thread between
    per_thread[0] and per_thread[1] values: enough to vectorize and hide latency, few enough to
    stay in registers. Never empty: else the one config nearest that range. With AUTOTUNE off,
    the one kept config nearest the middle of the range."""

    def load(c):
        return tile_elements(c) / (32 * c.num_warps)  # 32 threads a warp

    low, high = per_thread
    kept = [c for c in configs if low <= load(c) <= high]
    if not kept:
        too_big = all(load(c) > high for c in configs)
        return [min(configs, key=load) if too_big else max(configs, key=load)]
    if not AUTOTUNE:  # one config, the same on every rank: the middle load, the most warps
        middle = math.sqrt(low * high)
        return [min(kept, key=lambda c: (abs(math.log(load(c) / middle)), -c.num_warps))]
    return kept

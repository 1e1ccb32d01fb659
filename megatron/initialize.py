"""Start-up: torch.distributed from the launcher's environment, device, process groups, seeds.

Launchers supported: `torchrun` and the `deepspeed` launcher (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), Slurm `srun` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), MPI
launchers (`mpirun`/`horovodrun` with OpenMPI: OMPI_COMM_WORLD_*; MPICH/Intel MPI: PMI_RANK,
PMI_SIZE, MPI_LOCALRANKID; MVAPICH: MV2_COMM_WORLD_*), all with MASTER_ADDR/MASTER_PORT exported
by the batch script, and a plain `python` (one process).

Under `torchrun --max-restarts N` each restart is a new rendezvous on the same store: the keys of
the process groups are put under a per-attempt prefix (TORCHELASTIC_RESTART_COUNT), otherwise
the restarted ranks read the dead attempt's addresses and hang or fail to connect.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.config.declare import ConfigError
from megatron.config.schema import MegatronConfig
from megatron.config.schema_parallel import LAUNCHER_VARIABLES
from megatron.heartbeat import Heartbeat
from megatron.mpu.parallel_state import ParallelState, initialize_model_parallel
from megatron.mpu.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_seed


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str | None
    master_port: str | None
    restart_count: int = 0  # torchrun --max-restarts: which attempt this is (0: the first)


@dataclass(frozen=True)
class Runtime:
    """What initialization produced; passed explicitly to everything that needs it."""

    state: ParallelState
    device: torch.device
    rng_tracker: RNGStatesTracker
    heartbeat: Heartbeat | None = None  # names a stopped rank when a collective times out


def read_launch_env(env: dict[str, str] | None = None) -> LaunchEnv:
    """Rank, world size and local rank from torchrun/deepspeed variables, else Slurm's, else an
    MPI launcher's (OpenMPI, MPICH/Intel MPI, MVAPICH), else one process."""
    env = os.environ if env is None else env

    # The first launcher whose world-size variable is set names all three (never a mix).
    names = next((v for v in LAUNCHER_VARIABLES if env.get(v[1])), LAUNCHER_VARIABLES[0])
    rank, world, local = (env.get(n) or None for n in names)
    return LaunchEnv(
        rank=int(rank or 0),
        world_size=int(world or 1),
        local_rank=int(local) if local is not None else None,
        master_addr=env.get("MASTER_ADDR"),
        master_port=env.get("MASTER_PORT"),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
    )


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pick_backend(requested: str | None, device: torch.device) -> str:
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(
            "--distributed-backend nccl: no CUDA device is visible. Fix: use "
            "--distributed-backend gloo (or drop the flag) to run on CPU."
        )
    return requested or ("nccl" if device.type == "cuda" else "gloo")


def init_distributed(cfg: MegatronConfig, env: LaunchEnv, device: torch.device) -> None:
    """Create the default process group (skipped when already initialized by the caller)."""
    if dist.is_initialized():
        return
    if env.world_size != cfg.parallel.world_size:
        raise ConfigError(
            f"the launcher started {env.world_size} processes but the config was validated for "
            f"{cfg.parallel.world_size}. Fix: parse the arguments in the launched processes."
        )
    if env.world_size > 1 and not (env.master_addr and env.master_port):
        raise ConfigError(
            "MASTER_ADDR/MASTER_PORT are not set for a multi-process run. Fix: launch with "
            "torchrun or deepspeed, or export both (e.g. the first node's hostname and 29500; "
            "mpirun: `-x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500`)."
        )
    backend = pick_backend(cfg.distributed.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
    if env.world_size == 1 and not env.master_port:
        # A single process needs no launcher and no port: an in-memory store is enough.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    for name, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        if value:  # env:// reads them from the environment
            os.environ.setdefault(name, value)
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    # A restarted attempt reuses torchrun's store: its own prefix keeps the dead attempt's keys
    # (gloo/nccl addresses of ranks that no longer exist) out of sight.
    store = dist.PrefixStore(f"megatron/attempt_{env.restart_count}", store)
    dist.init_process_group(
        backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )


def set_random_seeds(seed: int, state: ParallelState, device: torch.device) -> RNGStatesTracker:
    """Seed python/numpy/torch with seed + 100 x PP rank + 10000 x CP rank; add the per-TP-rank
    dropout stream.

    TP peers share the default seed (their replicated activations must see the same dropout);
    the tracker's stream differs per TP rank for dropout on split tensors. CP ranks hold other
    tokens of the sequence, so both streams differ between them (CP 1 keeps the old seeds).
    """
    base = seed + 100 * state.pp_rank + 10_000 * state.cp_rank
    random.seed(base)
    np.random.seed(base)
    torch.manual_seed(base)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(base, state.tp_rank))
    return tracker


def initialize_megatron(cfg: MegatronConfig, env: LaunchEnv | None = None) -> Runtime:
    env = env or read_launch_env()
    local_rank = env.local_rank if env.local_rank is not None else cfg.distributed.local_rank or 0
    device = pick_device(local_rank)
    init_distributed(cfg, env, device)
    timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
    state = initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        cfg.parallel.virtual_pipeline_size(cfg.model.num_layers),
        timeout=timeout,
        sequence_parallel=cfg.parallel.sequence_parallel,
        context_parallel_size=cfg.parallel.context_parallel_size,
        expert_model_parallel_size=cfg.parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.parallel.expert_tp_size,
        pipeline_v=cfg.parallel.schedule.v_shape,
    )
    tracker = set_random_seeds(cfg.training.seed, state, device)
    heartbeat = Heartbeat.start_default(timeout.total_seconds())
    return Runtime(state=state, device=device, rng_tracker=tracker, heartbeat=heartbeat)


def barrier() -> None:
    """Wait for every rank (a no-op for one process or before init). The one barrier of the
    trainer: index building, checkpoint commits of both backends."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown_distributed() -> None:
    """Leave the process group cleanly (gloo can abort at interpreter exit otherwise)."""
    if dist.is_initialized():
        dist.destroy_process_group()

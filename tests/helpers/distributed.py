"""Spawn N CPU ranks on the gloo backend, run a function on each, fail fast with its traceback.

Ranks are forked from a forkserver that has imported torch and the trainer but run no torch
op (forking a process that already ran torch ops can hang in OpenMP), so each rank skips the
~2 s of imports a fresh `spawn` pays; the parent's environment of the moment is handed to each
rank. If one rank fails, the others are killed at once instead of waiting in a collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver; importing runs no torch op.
_PRELOAD = ["torch", "torch.distributed", "megatron.training.loop"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn, rank, world_size, port, results, args, init, extra_env):
    os.environ.clear()  # the parent's environment now, not the forkserver's at its start
    os.environ.update(extra_env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
            )
        value = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn, world_size: int, *args, timeout: float = 240, init: bool = True, env_per_rank=None
):
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return values by rank.

    `init=False` leaves process-group creation to `fn` (to test our own initialization); then
    `env_per_rank(rank)` gives the launcher variables each rank sees.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **(env_per_rank(rank) if env_per_rank else {})}
        p = ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args, init, env))
        p.start()
        procs.append(p)
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(values))} "
                    f"did not finish within {timeout:.0f}s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values
                ]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            if p.is_alive() and len(values) < world_size:
                p.kill()
            p.join(timeout=30)
    return [values[r] for r in range(world_size)]

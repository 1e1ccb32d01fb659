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

# Ports come from below the kernel's ephemeral range (Linux: 32768-60999), one block per
# pytest-xdist worker, in turn: a port the kernel handed out to any socket (gloo's own pair
# listeners and connections included) is never picked, and two workers never pick the same
# one. The old "bind to port 0 and close" returned an ephemeral port that another worker's
# gloo ranks could take before our TCPStore listened on it (EADDRINUSE, seen in CI).
_BLOCK, _FIRST = 1500, 15000
_next_offset = [None]


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = "".join(ch for ch in worker if ch.isdigit())
    return int(digits or 0) % 10


def free_port() -> int:
    base = _FIRST + _worker_index() * _BLOCK
    if _next_offset[0] is None:  # a random start: ports a previous run left in TIME_WAIT
        _next_offset[0] = (os.getpid() * 7919 + time.monotonic_ns()) % _BLOCK
    for _ in range(_BLOCK):
        port = base + _next_offset[0]
        _next_offset[0] = (_next_offset[0] + 1) % _BLOCK
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}-{base + _BLOCK - 1}")


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
    `env_per_rank(rank)` gives the launcher variables each rank sees. A run whose rendezvous
    port was taken by another process before rank 0 listened on it is started again (twice at
    most) on a new port.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, init, env_per_rank)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(AssertionError):
    """The rendezvous port was taken between choosing it and listening on it: run again."""


def _run_once(fn, world_size, args, timeout, init, env_per_rank):
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
            if not ok and "EADDRINUSE" in value and str(port) in value:
                raise _PortTaken(f"rank {rank} failed:\n{value}")
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            if p.is_alive() and len(values) < world_size:
                p.kill()
            p.join(timeout=30)
    return [values[r] for r in range(world_size)]

"""Name the rank that stopped answering when a collective times out.

A collective that times out only tells the rank that waited that *someone* did not come; the
operator needs the rank that stopped (SIGSTOP, a dead node, a deadlock in its own code). Every
rank therefore bumps a counter in the c10d store (the TCPStore of init) from a daemon thread.
A stopped or dead process stops bumping it, while ranks that are merely blocked in a collective
keep beating (the thread runs while the main thread waits in C++ with the GIL released). When a
collective fails, the rank that saw the failure reads every counter twice, a few beats apart, and
names the ranks whose counter did not move. A named rank that is a stopped process this one can
see (same machine and pid namespace) is ended with SIGKILL: it cannot take torchrun's SIGTERM,
and the job would wait 30 s more for torchrun's own SIGKILL.

The same thread notices a store that is gone. Under torchrun the store lives in the launcher's
agent; a scheduler that SIGKILLs the agent leaves the ranks (in their own session) training on
their own, orphans holding GPUs (a 1-rank job's rank too). After a few failed beats in a row
the heartbeat marks the store `lost`: the trainer stops at its next iteration boundary with
that message, and if this process is still running a while later the thread ends it (exit 1)
itself.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_KEY = "megatron/heartbeat/"
_FAILED_BEATS = 3  # failed writes in a row (retried every second) before the store counts as lost


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: a tenth of the collective timeout, within [0.2 s, 5 s].

    Short enough that a stopped rank is told apart within the margin after a timeout, long
    enough that the store sees at most a few small writes per second per rank.
    """
    return min(max(timeout_s / 10.0, 0.2), 5.0)


class Heartbeat:
    """A per-rank counter in a c10d store, bumped every `interval` seconds by a daemon thread."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval = beat_interval(timeout_s)
        self.lost: str | None = None  # why the store is gone, once it is
        self._stop = threading.Event()
        self.store.set(f"{_KEY}{rank}", "0")
        self.store.set(f"{_KEY}where/{rank}", f"{_pid_space()} {os.getpid()}")
        self._thread = threading.Thread(target=self._run, name="megatron-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start_default(cls, timeout_s: float) -> Heartbeat | None:
        """Beat into the default group's store. None for one process that no launcher's store
        watches over (nothing to wait for); one rank under torchrun beats too, so that it
        stops when the agent dies (every --fault-tolerance replica group is such a job: an
        orphan would go on joining quorums beside its replacement)."""
        if not dist.is_initialized():
            return None
        if dist.get_world_size() == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size(), timeout_s)

    def _run(self) -> None:
        n, failed, wait = 0, 0, self.interval
        while not self._stop.wait(wait):
            n += 1
            try:
                self.store.set(f"{_KEY}{self.rank}", str(n))
                failed, wait = 0, self.interval
            except Exception as e:  # a dead store fails at once (connection reset/refused)
                failed, wait = failed + 1, min(self.interval, 1.0)
                if failed >= _FAILED_BEATS:
                    self.lost = _lost_message(self.rank, e)
                    break
        if self.lost is not None and not self._stop.wait(max(3 * self.interval, 10.0)):
            # The main thread did not reach an iteration boundary (stuck in a step, a data
            # read, a server loop): end the process rather than leave it orphaned.
            print(f"error: {self.lost}", file=sys.stderr, flush=True)
            os._exit(1)

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> dict[int, int]:
        out = {}
        for r in range(self.world_size):
            key = f"{_KEY}{r}"
            out[r] = int(self.store.get(key)) if self.store.check([key]) else -1
        return out

    def silent_ranks(self) -> list[int] | str:
        """Ranks whose counter did not move over three beats, or a sentence if the store is gone.

        Called after a collective failed; takes about 3 x interval seconds (the bounded margin
        added to --distributed-timeout-minutes before the job exits).
        """
        try:
            self.store.set_timeout(timedelta(seconds=max(4 * self.interval, 2.0)))
            before = self._read()
            time.sleep(3 * self.interval)
            after = self._read()
        except Exception as e:  # rank 0's process (or the launcher) hosts the store
            return f"{_store_gone()} ({type(e).__name__})"
        return [r for r in range(self.world_size) if r != self.rank and after[r] <= before[r]]

    def end_here(self, ranks: list[int]) -> list[str]:
        """SIGKILL those of the silent `ranks` that are stopped (SIGSTOP) processes this one
        can see (same machine, same pid namespace), so that the job ends now: a stopped
        process takes no SIGTERM, and torchrun waits 30 s before its SIGKILL. Returns "rank
        (pid N)" for each one ended."""
        ended, here = [], _pid_space()
        for r in ranks:
            try:
                space, pid = self.store.get(f"{_KEY}where/{r}").decode().rsplit(" ", 1)
                if space != here or not _stopped(int(pid)):
                    continue
                os.kill(int(pid), signal.SIGKILL)
                ended.append(f"{r} (pid {pid})")
            except Exception:  # noqa: BLE001 - the store or the process is gone: nothing to end
                continue
        return ended


def _pid_space() -> str:
    """Which pids this process sees: the machine's boot and this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:?"  # no /proc: never matches a stopped process below


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _store_gone() -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the launcher's c10d store (torchrun's agent) is gone: the launcher was killed"
    return (
        "the c10d store at MASTER_ADDR:MASTER_PORT (hosted by rank 0) is gone: rank 0 has "
        "stopped or died"
    )


def _lost_message(rank: int, error: BaseException) -> str:
    return (
        f"rank {rank} lost the job: {_store_gone()} ({type(error).__name__} on "
        f"{_FAILED_BEATS} heartbeat writes in a row), so this rank stops instead of training "
        "orphaned. Fix: relaunch the job; it resumes from the last checkpoint with --load"
    )


def explain_collective_failure(
    heartbeat: Heartbeat | None, error: BaseException, timeout_minutes: float
) -> str | None:
    """A message naming the rank(s) that stopped answering, or None if every rank still beats."""
    if heartbeat is None:
        return None
    if heartbeat.lost:
        return heartbeat.lost
    if heartbeat.world_size == 1:  # a 1-rank job watching its launcher: no other rank to name
        return None
    silent = heartbeat.silent_ranks()
    if not silent:
        return None
    ended = [] if isinstance(silent, str) else heartbeat.end_here(silent)
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    who = (
        silent
        if isinstance(silent, str)
        else (
            f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering "
            "(no heartbeat in the c10d store: the process is stopped, dead, or its host is down)"
        )
    )
    if ended:
        who += f" (stopped: {', '.join(f'rank {e}' for e in ended)} ended with SIGKILL)"
    return (
        f"{who}; rank {heartbeat.rank} gave up waiting for it in a collective after "
        f"--distributed-timeout-minutes {timeout_minutes:g} ({type(error).__name__}: "
        f"{first_line}). Fix: check that process and its node (SIGSTOP, OOM killer, hardware), "
        "then restart from the last checkpoint with --load"
    )

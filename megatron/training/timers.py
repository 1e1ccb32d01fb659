"""Named wall-clock timers with levels, reported like Megatron's `--timing-log-level`.

Level 0 timers are always on (the iteration); level 1 adds forward/backward/optimizer; level 2
everything else (e.g. data loading, gradient all-reduce). With --timing-log-level 1 or 2, CUDA
work is synchronized before a timer reads the clock, so times mean the device's time, not the
launch time; at level 0 (the default) nothing is synchronized, so a step never waits for the
device on a timer's account (the log line's time per iteration is measured by the loop, which
waits for the device once per log line). While --profile's window is open every timer, of any
level, is also a named range (training/profiling.py); with --log-straggler the forward,
backward, optimizer and communication timers also feed the straggler detector's sections, at
any level (resilience/straggler.py).
"""

from __future__ import annotations

import time

import torch


class _Timer:
    def __init__(self, device: torch.device, sync: bool = True):
        self.device, self.elapsed_s, self._start = device, 0.0, None
        self.sync = sync and device.type == "cuda"

    def _sync(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError("timer stopped without being started")
        self._sync()
        self.elapsed_s += time.perf_counter() - self._start
        self._start = None


class _NullTimer:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


NULL_TIMER = _NullTimer()


class _RangedTimer:
    """A timer that is also a named profiler range (while --profile's window is open)."""

    def __init__(self, timer, name: str, ranges):
        self.timer, self.name, self.ranges = timer, name, ranges

    def start(self) -> None:
        self.timer.start()
        self.ranges.push(self.name)

    def stop(self) -> None:
        self.ranges.pop(self.name)
        self.timer.stop()


class Timers:
    def __init__(self, log_level: int = 0, device: torch.device | str = "cpu"):
        self.log_level, self.device = log_level, torch.device(device)
        self._timers: dict[str, _Timer] = {}
        self._null = _NullTimer()
        self.ranges = None  # training/profiling.Ranges while a profiling window is open
        self.sections = None  # resilience/straggler.StragglerDetector with --log-straggler

    def __call__(self, name: str, level: int = 0):
        timer = (
            self._null
            if level > self.log_level
            else self._timers.setdefault(name, _Timer(self.device, sync=self.log_level > 0))
        )
        if self.sections is not None:  # also timed per section, at any level, without a sync
            timer = self.sections.wrap(name, timer)
        return timer if self.ranges is None else _RangedTimer(timer, name, self.ranges)

    def pop_elapsed(self) -> dict[str, float]:
        """Seconds accumulated per timer since the last call; resets them."""
        out = {name: t.elapsed_s for name, t in self._timers.items()}
        for t in self._timers.values():
            t.elapsed_s = 0.0
        return out

    @staticmethod
    def format(elapsed: dict[str, float], iterations: int) -> str:
        parts = [
            f"{name}: {1000.0 * s / max(iterations, 1):.2f}" for name, s in sorted(elapsed.items())
        ]
        return "(ms per iteration) " + " | ".join(parts) if parts else ""

"""--profile: a torch profiler trace of a window of iterations on chosen ranks, with named ranges.

The window opens before iteration `--profile-step-start` + 1 and closes after iteration
`--profile-step-end` (the log's numbering; Megatron-core's flags and convention), so it records
end - start steps. While it is open:

- every timer of `training/timers.py` that starts and stops (forward-compute and
  backward-compute per micro batch, pipeline-send / pipeline-wait per message,
  grads-all-reduce, optimizer) is also a named range: a `record_function` (it shows in the torch
  trace, on CPU too) and, on CUDA, an NVTX range (it shows in Nsight Systems);
- on CUDA, cudaProfilerStart/Stop bracket the window, so
  `nsys profile --capture-range=cudaProfilerApi` (or `nvprof --profile-from-start off`)
  captures exactly these steps.

The trace is written when the window closes, one per profiled rank:
`PROFILE_DIR/rank{R}.{first iteration}.pt.trace.json`, a Chrome trace (chrome://tracing,
ui.perfetto.dev) that TensorBoard's profiler plugin (torch-tb-profiler) lists as worker rankR.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.autograd.profiler import record_function

from megatron.config.schema_logging import LoggingConfig


class Ranges:
    """Named ranges, pushed and popped by name (a timer starts and stops by name)."""

    def __init__(self, nvtx: bool):
        self.nvtx = nvtx
        self._open: dict[str, list[record_function]] = {}

    def push(self, name: str) -> None:
        rf = record_function(name)
        rf.__enter__()
        self._open.setdefault(name, []).append(rf)
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)

    def pop(self, name: str) -> None:
        stack = self._open.get(name)
        if not stack:
            return  # started before the window opened
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        stack.pop().__exit__(None, None, None)


def default_profile_dir(lg: LoggingConfig) -> str:
    return lg.profile_dir or lg.tensorboard_dir or "profile"


class Profiler:
    """Opens and closes the window around the loop's iterations; a no-op on other ranks."""

    def __init__(self, lg: LoggingConfig, rank: int, device: torch.device, timers, out=sys.stdout):
        self.enabled = lg.profile and rank in lg.profile_ranks
        self.start, self.end = lg.profile_step_start, lg.profile_step_end
        self.rank, self.timers, self.out = rank, timers, out
        self.cuda = device.type == "cuda"
        self.path = os.path.join(
            default_profile_dir(lg), f"rank{rank}.{self.start + 1}.pt.trace.json"
        )
        self._prof, self._first = None, True

    def before_step(self, iteration: int) -> None:
        """`iteration`: the steps done so far; the window opens before step start + 1."""
        if self.enabled and self._first and iteration > self.start:
            print(
                f" profiler: this run starts after iteration {iteration}, past the window "
                f"(--profile-step-start {self.start}); nothing will be recorded",
                file=self.out,
                flush=True,
            )
        self._first = False
        if not self.enabled or self._prof is not None or iteration != self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.start()
        self.timers.ranges = Ranges(nvtx=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # cudaProfilerStart

    def after_step(self, iteration: int) -> None:
        if self._prof is not None and iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Closes an open window (also when the run ends inside it) and writes the trace."""
        if self._prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()  # cudaProfilerStop
        self.timers.ranges = None
        prof, self._prof = self._prof, None
        prof.stop()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        prof.export_chrome_trace(self.path)
        print(
            f" profiler: rank {self.rank} trace written to {self.path}", file=self.out, flush=True
        )

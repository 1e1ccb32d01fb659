"""The straggler report (`--log-straggler`): from every rank's time per section, the slowest
and fastest ranks against the median of their pipeline stage, and the spread for TensorBoard
and W&B. Pure functions of the gathered numbers (megatron/resilience/straggler.py gathers them).

A rank's compute is forward + backward + optimizer + data (its own work); its communication
wait is not counted, since that is where the others wait for a straggler. Ranks are compared
within their pipeline stage (stages differ in work by design: the last holds the loss head).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SECTIONS = ("forward", "backward", "optimizer", "data", "comm-wait")
COMPUTE = ("forward", "backward", "optimizer", "data")


@dataclass(frozen=True)
class RankTimes:
    """One rank's milliseconds per iteration by section; `forward` as timed, data included."""

    rank: int
    host: str
    stage: int
    ms: dict[str, float]

    @property
    def sections(self) -> dict[str, float]:
        """The sections as reported: the forward without the data read inside it."""
        out = dict(self.ms)
        out["forward"] = max(self.ms["forward"] - self.ms["data"], 0.0)
        return out

    @property
    def compute(self) -> float:
        s = self.sections
        return sum(s[name] for name in COMPUTE)


def _ratios(rows: list[RankTimes]) -> dict[int, tuple[float, float]]:
    """rank -> (compute / median compute of its stage, that median)."""
    medians = {}
    for stage in {r.stage for r in rows}:
        medians[stage] = statistics.median(r.compute for r in rows if r.stage == stage)
    return {
        r.rank: (r.compute / medians[r.stage] if medians[r.stage] > 0 else 1.0, medians[r.stage])
        for r in rows
    }


def _rank_line(label: str, row: RankTimes, ratio: float, median: float) -> str:
    parts = " | ".join(f"{name} {ms:.1f}" for name, ms in row.sections.items())
    score = 1.0 / ratio if ratio > 0 else 1.0
    return (
        f"   {label}: rank {row.rank} ({row.host}, stage {row.stage}) compute {row.compute:.1f} "
        f"ms, {ratio:.2f}x the median {median:.1f} ms (relative performance {score:.2f}) | "
        f"{parts} |"
    )


def report_lines(
    rows: list[RankTimes], count: int, iteration: int, iterations: int
) -> tuple[list[str], dict[str, float]]:
    """The log lines (a summary, then the `count` slowest and fastest ranks, slowest first)
    and the scalars of the spread."""
    ratios = _ratios(rows)
    order = sorted(rows, key=lambda r: (-ratios[r.rank][0], r.rank))
    computes = [r.compute for r in rows]
    slow = order[0]
    lines = [
        f" straggler report at iteration {iteration} (ms per iteration over the last "
        f"{iterations}; compute = forward + backward + optimizer + data, without communication "
        f"wait; against the median of each pipeline stage) | compute min {min(computes):.1f} | "
        f"median {statistics.median(computes):.1f} | max {max(computes):.1f} | "
        f"slowest rank {slow.rank} ({slow.host}) {ratios[slow.rank][0]:.2f}x its stage's median |"
    ]
    n = min(count, len(rows))
    for i, row in enumerate(order[:n]):
        lines.append(_rank_line(f"slowest {i + 1}", row, *ratios[row.rank]))
    for i, row in enumerate(reversed(order[-n:])):
        lines.append(_rank_line(f"fastest {i + 1}", row, *ratios[row.rank]))
    scalars = {
        "straggler-compute-ms-min": min(computes),
        "straggler-compute-ms-median": statistics.median(computes),
        "straggler-compute-ms-max": max(computes),
        "straggler-max-over-median": ratios[slow.rank][0],
        "straggler-slowest-rank": float(slow.rank),
        "straggler-comm-wait-ms-max": max(r.ms["comm-wait"] for r in rows),
    }
    return lines, scalars

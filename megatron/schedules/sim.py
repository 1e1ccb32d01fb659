"""Pipeline schedules run as a timeline: every stage's action list (megatron.schedules) with
its sends and receives, no model, no torch.

Sends are asynchronous; a forward waits for the previous virtual stage's forward of the same
micro batch, a backward for the next virtual stage's backward (the last virtual stage's for
its own forward), a W for its own B; each waits `comm` more when the tensor crosses stages.
`simulate` runs the lists until every action ran, or raises naming the stuck actions: a
schedule it finishes cannot deadlock on a runtime that sends asynchronously and receives in
blocking order (megatron.training.pipeline). It returns the step time, each stage's idle
fraction (its bubble) and each stage's peak of micro batches held. With `overlap` it runs
DualPipeV's forward / backward pairs as the runtime overlaps them (both inputs received first),
which proves that order deadlock-free too.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.schedules.base import PipelineSchedule
from megatron.schedules.registry import get_schedule, schedule_actions


@dataclass(frozen=True)
class Costs:
    """Time of the forward, input backward and weight backward of one micro batch through one
    stage's share of the model (all its chunks together). A backward that computes both
    gradients (1F1B) costs b + w."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0


@dataclass
class Simulation:
    step_time: float
    busy: list[float]  # each stage's own work
    bubble: list[float]  # each stage's idle fraction of the step: 1 - busy / step_time
    peak: list[int]  # most micro batches each stage held (F ran, its last backward did not)
    timeline: list[list[tuple[float, float, tuple]]]  # per stage: (start, end, action)


class Deadlock(RuntimeError):
    pass


def check_lists(schedule: PipelineSchedule, P: int, M: int, V: int, lists: list[list]) -> None:
    """Every stage runs each (chunk, micro batch)'s F and B once and its W at most once, in
    the order F, B, W; raises naming the first that does not."""
    for s, actions in enumerate(lists):
        seen = {}
        for kind, c, mb in actions:
            before = {"F": None, "B": "F", "W": "B"}[kind]
            if (kind, c, mb) in seen or (before and (before, c, mb) not in seen):
                raise ValueError(f"{schedule} P={P} M={M} stage {s}: {kind}{c}.{mb} out of order")
            seen[(kind, c, mb)] = True
        for c in range(V):
            for mb in range(M):
                if ("B", c, mb) not in seen:
                    raise ValueError(f"{schedule} P={P} M={M} stage {s}: B{c}.{mb} missing")


def _dependency(schedule: PipelineSchedule, P: int, last: int, s: int, action: tuple):
    """(the action it waits for as (stage, action), crosses stages) or None."""
    kind, c, mb = action
    v = schedule.virtual_stage(P, s, c)
    if kind == "F" and v > 0:
        src, sc = schedule.stage_of(P, v - 1)
        return (src, ("F", sc, mb)), src != s
    if kind == "B" and v < last:
        src, sc = schedule.stage_of(P, v + 1)
        return (src, ("B", sc, mb)), src != s
    if kind == "B":
        return (s, ("F", c, mb)), False
    if kind == "W":
        return (s, ("B", c, mb)), False
    return None


def simulate(
    schedule: str | PipelineSchedule,
    P: int,
    M: int,
    V: int | None = None,
    costs: Costs = Costs(),
    comm: float = 0.0,
    overlap: bool = False,
) -> Simulation:
    """Run every stage's list of `schedule` for P stages and M micro batches. `overlap`:
    DualPipeV's pairs (PipelineSchedule.overlapped_pairs) run as the runtime overlaps them: one
    step that starts once both inputs (the forward's activation, the backward's gradient)
    arrived, takes both actions' time (the all-to-alls it hides are not modelled) and hands
    both outputs on at its end."""
    schedule = get_schedule(schedule)
    V = schedule.chunks_per_stage(V)
    lists = [schedule_actions(schedule, P, s, M, V) for s in range(P)]
    check_lists(schedule, P, M, V, lists)
    run = _Run(schedule, P, V, lists, costs, comm, overlap)
    while any([run.advance(s) for s in range(P)]):  # a list: every stage advances each round
        pass
    stuck = [(s, lists[s][run.heads[s]]) for s in range(P) if run.heads[s] < len(lists[s])]
    if stuck:
        raise Deadlock(f"{schedule} P={P} M={M}: stages wait forever at {stuck}")
    step = max(run.free)
    bubble = [1 - b / step for b in run.busy]
    return Simulation(step, run.busy, bubble, run.peak, run.timeline)


class _Run:
    """The stages' clocks while simulate() runs their lists."""

    def __init__(self, schedule, P, V, lists, costs, comm, overlap):
        self.schedule, self.P, self.lists, self.comm = schedule, P, lists, comm
        self.last = P * V - 1
        self.split = [{(c, mb) for kind, c, mb in acts if kind == "W"} for acts in lists]
        self.pairs = [
            schedule.overlapped_pairs(acts, s == P - 1) if overlap else set()
            for s, acts in enumerate(lists)
        ]
        self.cost = {"F": costs.f / V, "B": costs.b / V, "W": costs.w / V}
        self.done: dict[tuple, float] = {}  # (stage, action) -> end time
        self.free, self.busy = [0.0] * P, [0.0] * P
        self.held, self.peak, self.heads = [0] * P, [0] * P, [0] * P
        self.timeline: list[list] = [[] for _ in range(P)]

    def _ready(self, s: int, action: tuple) -> float | None:
        """When the action's input is here (None: not yet produced)."""
        dep = _dependency(self.schedule, self.P, self.last, s, action)
        if dep is None:
            return 0.0
        if dep[0] not in self.done:
            return None
        return self.done[dep[0]] + (self.comm if dep[1] else 0.0)

    def advance(self, s: int) -> bool:
        """Run stage s's next actions (a pair as one) while their inputs are there."""
        progressed = False
        while self.heads[s] < len(self.lists[s]):
            i = self.heads[s]
            group = self.lists[s][i : i + (2 if i in self.pairs[s] else 1)]
            ready = [self._ready(s, action) for action in group]
            if None in ready:
                break
            self._run(s, group, max(ready))
            self.heads[s] += len(group)
            progressed = True
        return progressed

    def _run(self, s: int, group: list, ready: float) -> None:
        start = max(self.free[s], ready)
        took = 0.0
        for kind, c, mb in group:
            full = kind == "B" and (c, mb) not in self.split[s]  # computes the W too
            took += self.cost[kind] + (self.cost["W"] if full else 0.0)
        self.free[s] = start + took
        self.busy[s] += took
        for kind, c, mb in group:
            self.done[(s, (kind, c, mb))] = self.free[s]
            self.timeline[s].append((start, self.free[s], (kind, c, mb)))
            released = _releases(kind, c, mb, self.split[s])
            self.held[s] += 1 if kind == "F" else -1 if released else 0
            self.peak[s] = max(self.peak[s], self.held[s])


def _releases(kind: str, c: int, mb: int, split: set) -> bool:
    """The action after which a micro batch's activations of chunk c are gone."""
    return kind == "W" or (kind == "B" and (c, mb) not in split)


def textbook_bubble(
    schedule: str | PipelineSchedule, P: int, M: int, V: int | None = None, costs=Costs()
) -> float | None:
    """The papers' idle fraction of a step, each schedule's `textbook_idle` over the step: 1F1B
    (P - 1) / (M + P - 1) at any costs, interleaved with (P - 1) / V stages of fill, ZB-H1
    (P - 1)(f + b - w) of idle time (Qi et al. 2023), ZBV (P - 1) t / 2 at equal costs t once
    M >= 2P - 1 (what `simulate` finds). None where no closed form is published (DualPipeV)."""
    schedule = get_schedule(schedule)
    if schedule.textbook_idle is None:
        return None
    idle = schedule.textbook_idle(P, M, schedule.chunks_per_stage(V), costs)
    if idle is None:
        return None
    return idle / (idle + M * (costs.f + costs.b + costs.w))


__all__ = ["Costs", "Deadlock", "Simulation", "simulate", "textbook_bubble"]

"""The pipeline schedules of megatron.schedules run as a timeline, with no model."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.schedules.one_f_one_b import pipeline_actions


@dataclass
class Timeline:
    peak: list[int]  # the most forwards alive (activations held) on each stage
    makespan: float  # when the last stage finishes its last action
    busy: float  # one stage's own work: M V (forward + backward) / V


def simulate(P: int, M: int, V: int = 1, forward: float = 1.0, backward: float = 2.0):
    """Run every stage's action list: sends are asynchronous and free, a receive blocks until
    the sender finished that action; a chunk's forward costs forward / V, its backward
    backward / V. Raises on a deadlock."""
    todo = {s: list(pipeline_actions(P, s, M, V)) for s in range(P)}
    finished: dict[tuple, float] = {}  # message ('F'|'B', to virtual stage, mb) -> its time
    free, alive, peak = [0.0] * P, [0] * P, [0] * P
    while any(todo.values()):
        progressed = False
        for s in range(P):
            while todo[s]:
                kind, c, mb = todo[s][0]
                v = c * P + s
                need = (
                    ("F", v, mb)
                    if kind == "F" and v > 0
                    else ("B", v, mb)
                    if kind == "B" and v < P * V - 1
                    else None
                )
                if need is not None and need not in finished:
                    break
                todo[s].pop(0)
                progressed = True
                start = max(free[s], finished.get(need, 0.0))
                free[s] = start + (forward if kind == "F" else backward) / V
                if kind == "F":
                    finished[("F", v + 1, mb)] = free[s]
                    alive[s] += 1
                    peak[s] = max(peak[s], alive[s])
                else:
                    finished[("B", v - 1, mb)] = free[s]
                    alive[s] -= 1
        if not progressed:
            raise AssertionError(f"deadlock: P={P} V={V} M={M}")
    return Timeline(peak, max(free), M * (forward + backward))

"""The pipeline schedules by name: --pipeline-schedule's choices, its help and its default, and
the lists of a schedule given by name or as the object.

    register(PipelineSchedule(name="mine", build=my_actions))  # then --pipeline-schedule mine

The names are read when asked (`Names`), so a schedule registered after the config was
imported is a valid choice at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from megatron.schedules.base import Action, PipelineSchedule
from megatron.schedules.one_f_one_b import INTERLEAVED, ONE_F_ONE_B
from megatron.schedules.zero_bubble import DUALPIPEV, ZB_H1, ZBV

_REGISTRY: dict[str, PipelineSchedule] = {}


def register(schedule: PipelineSchedule) -> PipelineSchedule:
    """Make `schedule` a --pipeline-schedule choice (in registration order)."""
    if schedule.name in _REGISTRY:
        raise ValueError(f"pipeline schedule {schedule.name!r} is already registered")
    _REGISTRY[schedule.name] = schedule
    return schedule


@contextlib.contextmanager
def registered(schedule: PipelineSchedule) -> Iterator[PipelineSchedule]:
    """`schedule` registered for the block only (a test's own schedule)."""
    register(schedule)
    try:
        yield schedule
    finally:
        del _REGISTRY[schedule.name]


for _builtin in (ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZBV, DUALPIPEV):
    register(_builtin)


def schedules() -> list[PipelineSchedule]:
    return list(_REGISTRY.values())


def get_schedule(schedule: str | PipelineSchedule) -> PipelineSchedule:
    """The registered schedule of that name (an object is returned as it is)."""
    if isinstance(schedule, PipelineSchedule):
        return schedule
    if schedule not in _REGISTRY:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {tuple(_REGISTRY)}")
    return _REGISTRY[schedule]


def default_schedule(chunked: bool) -> PipelineSchedule:
    """The schedule run when none is named: interleaved with model chunks, else 1F1B (what a
    Megatron user gets)."""
    return INTERLEAVED if chunked else ONE_F_ONE_B


def is_default(schedule: str | PipelineSchedule) -> bool:
    """Whether it is one of the schedules run when none is named (the planner tries both)."""
    return get_schedule(schedule) in (default_schedule(False), default_schedule(True))


def resolve_schedule(schedule: str | PipelineSchedule | None, chunked: bool) -> PipelineSchedule:
    """The schedule named, or the default for the chunks."""
    return default_schedule(chunked) if schedule is None else get_schedule(schedule)


class Names:
    """The registered names (of the schedules `where` holds for), read at each use."""

    def __init__(self, where: Callable[[PipelineSchedule], bool] = lambda s: True):
        self.where = where

    def __iter__(self) -> Iterator[str]:
        return iter([s.name for s in schedules() if self.where(s)])

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY and self.where(_REGISTRY[name])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return repr(tuple(self))


SCHEDULES = Names()
V_SHAPED = Names(lambda s: s.v_shape)
SPLIT_BACKWARD = Names(lambda s: s.split_backward)
OVERLAPS_PAIRS = Names(lambda s: s.overlaps_pairs)


def flag_help() -> str:
    """--pipeline-schedule's help: each schedule with what it does, and the default."""
    items = [s.name + (f" ({s.help})" if s.help else "") for s in schedules()]
    listed = "; ".join(items[:-1]) + " and " + items[-1]
    return (
        f"the pipeline-parallel schedule (megatron/schedules/): {listed}. Default: "
        f"{default_schedule(True)} when --num-layers-per-virtual-pipeline-stage is given, "
        f"else {default_schedule(False)}"
    )


def schedule_actions(
    schedule: str | PipelineSchedule, P: int, s: int, M: int, V: int = 1, forward_only=False
) -> list[Action]:
    """Stage s's action list under `schedule` (V: chunks per stage, 2 for the V shapes)."""
    return get_schedule(schedule).actions(P, s, M, V, forward_only)


def overlapped_pairs(
    schedule: str | PipelineSchedule, actions: list[Action], last_stage: bool = False
) -> set[int]:
    return get_schedule(schedule).overlapped_pairs(actions, last_stage)


def messages(schedule: str | PipelineSchedule, P: int, M: int, V: int = 1) -> tuple[dict, dict]:
    return get_schedule(schedule).messages(P, M, V)


def check_message_order(
    P: int, M: int, V: int = 1, schedule: str | PipelineSchedule | None = None
) -> None:
    """Raise if some rank pair would send and receive messages in different orders."""
    schedule = resolve_schedule(schedule, chunked=V > 1)
    sent, received = schedule.messages(P, M, V)
    if sent != received:
        raise RuntimeError(
            f"pipeline schedule {schedule} P={P} V={V} M={M}: send/receive orders differ"
        )

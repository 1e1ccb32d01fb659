"""The pipeline schedules as objects: one registry, read by everything else; no schedule named
outside megatron/schedules/; the textbook bubble the simulator's where one is published."""

import re

import pytest

from megatron.config.cli import parse_args
from megatron.schedules.base import PipelineSchedule, stage_of, virtual_stage
from megatron.schedules.registry import (
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    default_schedule,
    get_schedule,
    registered,
    schedules,
)
from megatron.schedules.sim import Costs, simulate, textbook_bubble
from tests.helpers.paths import ROOT
from tests.helpers.training import BASE

# Every built-in schedule's name; "interleaved" is also an English word, so for it only a
# quoted literal or a flag value counts as a spelling.
_NAMES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
_SPELLED = re.compile(
    r"(?<![\w-])(1f1b|zb-h1|zbv|dualpipev)(?![\w-])|[\"']interleaved[\"']|schedule interleaved"
)


def test_no_schedule_is_named_outside_its_package():
    """Code asks the schedule object (`.v_shape`, `.split_backward`, ...) instead of comparing
    names, and messages take names from the objects: comments and docstrings too."""
    assert tuple(SCHEDULES) == _NAMES, "a new built-in schedule: add its name to _NAMES"
    package = ROOT / "megatron" / "schedules"
    found = []
    for path in (ROOT / "megatron").rglob("*.py"):
        if package in path.parents:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _SPELLED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "schedule names outside megatron/schedules/:\n" + "\n".join(found)


def test_the_registry_is_the_flags_choices_and_the_objects_answer():
    assert [s.name for s in schedules()] == list(SCHEDULES)
    assert list(V_SHAPED) == ["zbv", "dualpipev"] and "zb-h1" in SPLIT_BACKWARD
    assert default_schedule(chunked=False) is get_schedule("1f1b")
    assert default_schedule(chunked=True) is get_schedule("interleaved")
    cfg = parse_args([*BASE, "--pipeline-model-parallel-size", "2"], world_size=2)
    assert cfg.parallel.schedule is get_schedule("1f1b")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'nope'"):
        get_schedule("nope")
    mine = PipelineSchedule("mine", build=get_schedule("1f1b").build)
    with registered(mine):
        assert "mine" in SCHEDULES and get_schedule("mine") is mine
        with pytest.raises(ValueError, match="already registered"), registered(mine):
            pass
    assert "mine" not in SCHEDULES


def test_virtual_stages_of_the_loop_and_the_v():
    """One arithmetic for the model's layers and the schedules' messages."""
    assert [virtual_stage(4, s, c) for c in (0, 1) for s in range(4)] == list(range(8))
    assert [virtual_stage(4, 0, c, v_shape=True) for c in (0, 1)] == [0, 7]
    for v_shape in (False, True):
        for v in range(8):
            s, c = stage_of(4, v, v_shape)
            assert virtual_stage(4, s, c, v_shape) == v


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_the_textbook_bubble_is_the_simulators_where_one_is_published(P):
    """ZBV's idle is the first forward's way down the V's first leg, (P - 1) t / 2 per rank at
    equal costs t (docs/parallelism.md), not zero; 1F1B and ZB-H1 at any costs."""
    for M in (2 * P - 1, 2 * P, 4 * P):
        for t in (1.0, 2.5):
            costs = Costs(t, t, t)
            run = simulate("zbv", P, M, costs=costs)
            assert run.step_time - run.busy[0] == pytest.approx((P - 1) * t / 2)
            for stage_bubble in run.bubble:
                assert stage_bubble == pytest.approx(textbook_bubble("zbv", P, M, costs=costs))
        unequal = Costs(1.0, 1.2, 0.8)
        for schedule in ("1f1b", "zb-h1"):
            run = simulate(schedule, P, M, costs=unequal)
            assert run.bubble[0] == pytest.approx(textbook_bubble(schedule, P, M, costs=unequal))
        assert textbook_bubble("zbv", P, M, costs=unequal) is None  # the bound needs t = t = t
    assert textbook_bubble("zbv", P, 2 * P - 2) is None
    assert textbook_bubble("dualpipev", P, 4 * P) is None

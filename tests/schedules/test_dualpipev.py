"""DualPipeV's overlapped pairs as DeepSeek's reference (deepseek-ai/DualPipe, dualpipev.py)
runs them: every stage overlaps its steady state's forward / backward pairs, except the last
stage's first, whose halves run one after the other."""

import dataclasses

import pytest

from megatron.schedules.registry import get_schedule, overlapped_pairs, schedule_actions
from megatron.schedules.sim import Costs, simulate


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 12), (6, 14)])
def test_the_last_stage_runs_its_first_pair_alone_like_the_reference(P, M):
    for s in range(P):
        actions = schedule_actions("dualpipev", P, s, M, 2)
        everywhere = sorted(overlapped_pairs("dualpipev", actions))
        # the reference's steps 4 and 5: two pairs per main-step round, one per step-5 round
        assert len(everywhere) == 2 * (M - 2 * P + s + 1) + (P - s - 1), (P, M, s)
        pairs = sorted(overlapped_pairs("dualpipev", actions, last_stage=s == P - 1))
        assert pairs == (everywhere[1:] if s == P - 1 else everywhere), (P, M, s)
    # The pair left alone: step 4's first, the forward of micro batch P down the V's first
    # leg and the first backward of the second chunk (the reference's `if self.is_last_rank`).
    actions = schedule_actions("dualpipev", P, P - 1, M, 2)
    first = everywhere[0]
    assert actions[first : first + 2] == [("F", 0, P), ("B", 1, 0)]
    assert not any(kind == "B" for kind, _, _ in actions[:first])


def test_running_it_alone_lets_the_forward_start_before_the_gradient_arrives():
    """Why the reference leaves that pair alone, measured: a pair starts once both inputs came,
    so with a message delay (or a backward dearer than the forward) the last stage's forward
    waits for the gradient; alone it runs meanwhile, and the step is half a chunk's forward
    shorter."""
    dualpipev = get_schedule("dualpipev")
    all_paired = dataclasses.replace(dualpipev, last_stage_alone=0)
    for costs, comm in ((Costs(), 0.2), (Costs(1.0, 2.0, 1.0), 0.0)):
        for P, M in ((4, 8), (8, 16)):
            ours = simulate(dualpipev, P, M, costs=costs, comm=comm, overlap=True)
            paired = simulate(all_paired, P, M, costs=costs, comm=comm, overlap=True)
            assert ours.step_time == pytest.approx(paired.step_time - costs.f / 2), (P, M)
    assert simulate(dualpipev, 4, 8).step_time == simulate(all_paired, 4, 8).step_time

"""1F1B and interleaved 1F1B (Narayanan et al. 2021): after a warm-up of forwards, one forward
and one backward in turn; interleaved runs V chunks per stage in the loop placement, P micro
batches per chunk in turn."""

from __future__ import annotations

from megatron.schedules.base import Action, PipelineSchedule, forward_order


def pipeline_actions(
    P: int, s: int, M: int, V: int = 1, forward_only: bool = False
) -> list[Action]:
    """1F1B / interleaved: stage s's ('F'|'B', chunk, micro batch) list. The warm-up is as deep
    as the stages after this one (plus the extra chunks when interleaved), so the last stage
    alternates at once."""
    total = M * V
    forwards = [("F", *forward_order(k, P, V)) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [("B", V - 1 - c, mb) for c, mb in (forward_order(k, P, V) for k in range(total))]
    warmup = min(P - s - 1, M) if V == 1 else min((P - s - 1) * 2 + (V - 1) * P, total)
    actions = forwards[:warmup]
    for i in range(total - warmup):  # steady state: one forward, one backward
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[total - warmup :]


def _fill_and_drain(P: int, M: int, V: int, costs) -> float:
    """(P - 1) forwards and backwards of a stage's share, over V chunks: 1F1B's idle time at
    any costs, interleaved's with (P - 1) / V stages of fill."""
    return (P - 1) * (costs.f + costs.b + costs.w) / V


ONE_F_ONE_B = PipelineSchedule(
    name="1f1b",
    build=lambda P, s, M, V: pipeline_actions(P, s, M, V),
    textbook_idle=lambda P, M, V, costs: _fill_and_drain(P, M, 1, costs),
)

INTERLEAVED = PipelineSchedule(
    name="interleaved",
    build=lambda P, s, M, V: pipeline_actions(P, s, M, V),
    help="model chunks of --num-layers-per-virtual-pipeline-stage layers",
    chunks=None,
    whole_rounds=True,
    textbook_idle=_fill_and_drain,
)

"""The zero-bubble schedules (Qi et al. 2023, 2024; DeepSeek-V3): each backward split into the
input gradient (B, which the previous stage waits for) and the weight gradient (W, which nobody
waits for and so fills the holes).

- ZB-H1: 1F1B's order, its backwards split, the W's of stage s delayed by s micro batches: the
  bubble of 1F1B cut to about a third at 1F1B's peak activations;
- ZBV: two chunks per stage placed in a V; the first micro batch's way down is all its idle;
- DualPipeV: the V of ZBV whose steady state pairs a forward with a full backward of the other
  chunk (`PipelineSchedule.overlapped_pairs`), which the runtime overlaps when the stage has
  expert-parallel all-to-alls to hide. The last stage runs its first pair's halves one after
  the other, as DeepSeek's reference does: a pair starts once both its inputs came, and alone
  the forward runs while the backward's gradient is still on its way (the simulator finds the
  step half a chunk's forward shorter whenever the two arrive apart).
"""

from __future__ import annotations

from megatron.schedules.base import Action, PipelineSchedule
from megatron.schedules.one_f_one_b import pipeline_actions


def zb_h1_actions(P: int, s: int, M: int) -> list[Action]:
    """ZB-H1: 1F1B's forwards and input backwards; from its (s+1)-th backward on, stage s runs
    the W of its oldest pending backward after each backward, the rest at the end. Every stage
    then holds at most P micro batches (1F1B's first-stage peak), and the W's fill the
    cool-down the first stages idle in under 1F1B."""
    actions, pending = [], []
    for kind, c, mb in pipeline_actions(P, s, M):
        actions.append((kind, c, mb))
        if kind == "B":
            pending.append(mb)
            if mb >= s:  # 1F1B's backwards run in micro-batch order
                actions.append(("W", 0, pending.pop(0)))
    return actions + [("W", 0, mb) for mb in pending]


class _Counter:
    """Builds a V-shaped stage's list: the next micro batch of each (kind, chunk)."""

    def __init__(self, M: int):
        self.M, self.next, self.actions, self.weights = M, {}, [], []

    def add(self, kind: str, c: int, split: bool = True) -> None:
        mb = self.next.get((kind, c), 0)
        self.next[(kind, c)] = mb + 1
        if mb >= self.M:  # past the step's micro batches: the slot stays empty
            return
        self.actions.append((kind, c, mb))
        if kind == "B" and split:
            self.weights.append((c, mb))

    def weight(self) -> None:
        if self.weights:
            self.actions.append(("W", *self.weights.pop(0)))

    def flush(self) -> list[Action]:
        while self.weights:
            self.weight()
        return self.actions


def zbv_actions(P: int, s: int, M: int) -> list[Action]:
    """ZBV (the zero-bubble paper's V schedule): chunk 0 forwards until the V's bottom turns,
    then each micro batch's F, B, W per chunk, the cool-down's W's at the end. Built for
    max(M, 2P - 1) micro batches; those past M leave their slots empty."""
    n, k = max(M, 2 * P - 1), _Counter(M)
    for _ in range(2 * (P - s) - 1):
        k.add("F", 0)
    for _ in range(s):
        k.add("F", 1)
        k.add("F", 0)
    for _ in range(P - s):
        k.add("F", 1)
        k.add("B", 1)
        k.weight()
    while k.next.get(("F", 1), 0) < k.next.get(("F", 0), 0) or k.next.get(("F", 0), 0) < n:
        if k.next.get(("F", 0), 0) < n:
            k.add("F", 0)
        k.add("B", 0)
        k.weight()
        k.add("F", 1)
        k.add("B", 1)
        k.weight()
    for _ in range(s):
        k.add("B", 0)
        k.add("B", 1)
    for _ in range(P - s):
        k.add("B", 0)
        k.weight()
    return k.flush()


def dualpipev_actions(P: int, s: int, M: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3): the V of ZBV with, in its steady state, the forward of one
    chunk next to the (full) backward of the other, a pair a runtime can overlap so that the
    MoE all-to-all of one hides behind the compute of the other; the cool-down's second half
    splits its backwards and fills the tail with the W's. Needs M >= 2P."""
    k = _Counter(M)
    for _ in range((P - s - 1) * 2):
        k.add("F", 0)
    for _ in range(s + 1):
        k.add("F", 0)
        k.add("F", 1)
    for _ in range(P - s - 1):
        k.add("B", 1)
        k.weight()
        k.add("F", 1)
    for _ in range(M - 2 * P + s + 1):
        k.add("F", 0)
        k.add("B", 1, split=False)
        k.add("F", 1)
        k.add("B", 0, split=False)
    for _ in range(P - s - 1):
        k.add("B", 1, split=False)
        k.add("F", 1)
        k.add("B", 0, split=False)
    split = False
    for i in range(s + 1):
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        k.add("B", 1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        k.add("B", 0, split)
    for _ in range(P - s - 1):
        k.weight()
        k.add("B", 0, split)
    return k.flush()


def _zb_h1_idle(P: int, M: int, V: int, costs) -> float:
    """(P - 1)(f + b - w): the W's fill all of 1F1B's cool-down they can (Qi et al. 2023)."""
    return (P - 1) * max(0.0, costs.f + costs.b - costs.w)


def _zbv_idle(P: int, M: int, V: int, costs) -> float | None:
    """(P - 1) t / 2 once M >= 2P - 1, at equal costs t: the first forward's way down the V's
    first leg, half a stage's forward per stage, is all a stage idles (the simulator finds the
    same). None at unequal costs, where the paper's bound does not hold."""
    if M < 2 * P - 1 or not costs.f == costs.b == costs.w:
        return None
    return (P - 1) * costs.f / 2


ZB_H1 = PipelineSchedule(
    name="zb-h1",
    build=lambda P, s, M, V: zb_h1_actions(P, s, M),
    help="zero bubble: 1F1B with each backward split into the input gradient and a later "
    "weight gradient that fills the bubble, at 1F1B's activation memory",
    split_backward=True,
    textbook_idle=_zb_h1_idle,
)

ZBV = PipelineSchedule(
    name="zbv",
    build=lambda P, s, M, V: zbv_actions(P, s, M),
    help="two chunks per stage placed in a V, stage 0 holding the first and the last layers, "
    "zero bubble at about 1F1B's memory",
    chunks=2,
    v_shape=True,
    split_backward=True,
    textbook_idle=_zbv_idle,
)

DUALPIPEV = PipelineSchedule(
    name="dualpipev",
    build=lambda P, s, M, V: dualpipev_actions(P, s, M),
    help="DeepSeek-V3's order on the same V",
    chunks=2,
    v_shape=True,
    split_backward=True,
    overlaps_pairs=True,
    last_stage_alone=1,
)

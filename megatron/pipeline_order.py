"""The order of a pipeline stage's work: each schedule's list of forwards and backwards.

Pure arithmetic, no torch: the training schedule (megatron.training.pipeline) runs these lists,
the simulator (megatron.pipeline_sim) times them and proves them deadlock-free, and the planner
(megatron.planning.memory) walks them to find a stage's activation peak, so all read the same
order from here.

With P stages, V model chunks per stage and M micro batches, stage s runs a list of actions
(kind, chunk, micro batch):

- 'F': the chunk's forward of the micro batch (its input received from the previous virtual
  stage, its output sent to the next);
- 'B': its backward to the input (the gradient sent to the previous virtual stage). When the
  list has no 'W' for the same (chunk, micro batch), this backward computes the weight
  gradients too (1F1B, interleaved);
- 'W': the weight gradients of a 'B' that ran earlier (zero-bubble schedules): nobody waits
  for them, so they fill the holes a stage would otherwise idle in.

Schedules (`--pipeline-schedule`): '1f1b'; 'interleaved' (V chunks, chunk c of stage s is
virtual stage c P + s, "loop" placement); 'zb-h1' (1F1B's order, its backwards split, the
W's of stage s delayed by s micro batches: the bubble of 1F1B cut to about a third at 1F1B's
peak activations); 'zbv' and 'dualpipev' (two chunks per stage placed in a V: chunk 0 of stage
s is virtual stage s, chunk 1 is virtual stage 2 P - 1 - s, so the first stage also holds the
last virtual stage). DualPipeV's steady state pairs a forward with a full backward of the
other chunk (`overlapped_pairs`), which the runtime overlaps when the stage has expert-parallel
all-to-alls to hide.
"""

from __future__ import annotations

Action = tuple[str, int, int]
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")


def virtual_stage(schedule: str, P: int, s: int, c: int) -> int:
    """The virtual stage (0 .. P V - 1) that chunk c of stage s runs."""
    if schedule in V_SHAPED:
        return s if c == 0 else 2 * P - 1 - s
    return c * P + s


def stage_of(schedule: str, P: int, v: int) -> tuple[int, int]:
    """(stage, chunk) running virtual stage v: the inverse of virtual_stage."""
    if schedule in V_SHAPED:
        return (v, 0) if v < P else (2 * P - 1 - v, 1)
    return v % P, v // P


def forward_order(k: int, P: int, V: int) -> tuple[int, int]:
    """The k-th forward of a stage: (chunk, micro batch). Groups of P micro batches per chunk."""
    return (k // P) % V, (k // (P * V)) * P + k % P


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


def schedule_actions(
    schedule: str, P: int, s: int, M: int, V: int = 1, forward_only: bool = False
) -> list[Action]:
    """Stage s's action list under `schedule` (V: chunks per stage, 2 for the V shapes)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    if forward_only:  # evaluation: every forward in virtual-stage order, nothing to overlap
        if schedule in V_SHAPED:
            return [("F", c, mb) for mb in range(M) for c in (0, 1)]
        return pipeline_actions(P, s, M, V, forward_only=True)
    if schedule == "zb-h1":
        return zb_h1_actions(P, s, M)
    if schedule == "zbv":
        return zbv_actions(P, s, M)
    if schedule == "dualpipev":
        return dualpipev_actions(P, s, M)
    return pipeline_actions(P, s, M, V)


def overlapped_pairs(schedule: str, actions: list[Action]) -> set[int]:
    """DualPipeV's steady-state pairs: the indices i where actions[i] is a forward and
    actions[i + 1] a full backward (no W of its own) of the other chunk, which the runtime
    overlaps (megatron.mpu.overlap) once both their inputs arrived. Empty for the other
    schedules."""
    if schedule != "dualpipev":
        return set()
    split = {(c, mb) for kind, c, mb in actions if kind == "W"}
    pairs = set()
    for i in range(len(actions) - 1):
        (kind, c, _), (after, c2, mb2) = actions[i], actions[i + 1]
        if kind == "F" and after == "B" and c2 != c and (c2, mb2) not in split:
            pairs.add(i)
    return pairs


def messages(schedule: str, P: int, M: int, V: int = 1) -> tuple[dict, dict]:
    """Per (sender, receiver) stage pair: the messages sent, and those received, in order.
    A message is ('F'|'B', receiving virtual stage, micro batch); a stage handing a tensor to
    itself (the V's bottom) sends nothing."""
    sent, received, last = {}, {}, P * V - 1
    for s in range(P):
        for kind, c, mb in schedule_actions(schedule, P, s, M, V):
            v = virtual_stage(schedule, P, s, c)
            if kind == "F" and v < last:
                to = stage_of(schedule, P, v + 1)[0]
                if to != s:
                    sent.setdefault((s, to), []).append(("F", v + 1, mb))
            if kind == "F" and v > 0:
                frm = stage_of(schedule, P, v - 1)[0]
                if frm != s:
                    received.setdefault((frm, s), []).append(("F", v, mb))
            if kind == "B" and v > 0:
                to = stage_of(schedule, P, v - 1)[0]
                if to != s:
                    sent.setdefault((s, to), []).append(("B", v - 1, mb))
            if kind == "B" and v < last:
                frm = stage_of(schedule, P, v + 1)[0]
                if frm != s:
                    received.setdefault((frm, s), []).append(("B", v, mb))
    return sent, received


def check_message_order(P: int, M: int, V: int = 1, schedule: str | None = None) -> None:
    """Raise if some rank pair would send and receive messages in different orders."""
    schedule = schedule or ("interleaved" if V > 1 else "1f1b")
    sent, received = messages(schedule, P, M, V)
    if sent != received:
        raise RuntimeError(
            f"pipeline schedule {schedule} P={P} V={V} M={M}: send/receive orders differ"
        )

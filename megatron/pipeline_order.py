"""The order of a pipeline stage's work: which forward and backward runs when (1F1B, interleaved).

Pure arithmetic, no torch: the training schedule (megatron.training.pipeline) runs these lists
and the planner (megatron.planning.memory) walks them to find a stage's activation peak, so both
read the same order from here.

With P stages, V model chunks per stage and M micro batches, stage s runs a list of actions
('F' or 'B', chunk, micro batch): some warm-up forwards, then one forward and one backward in
turn, then the remaining backwards.
"""

from __future__ import annotations

Action = tuple[str, int, int]


def forward_order(k: int, P: int, V: int) -> tuple[int, int]:
    """The k-th forward of a stage: (chunk, micro batch). Groups of P micro batches per chunk."""
    return (k // P) % V, (k // (P * V)) * P + k % P


def pipeline_actions(
    P: int, s: int, M: int, V: int = 1, forward_only: bool = False
) -> list[Action]:
    """Stage s's ('F'|'B', chunk, micro batch) list. The warm-up is as deep as the stages after
    this one (plus the extra chunks when interleaved), so the last stage alternates at once."""
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


def check_message_order(P: int, M: int, V: int = 1) -> None:
    """Raise if some rank pair would send and receive messages in different orders."""
    sent, received = {}, {}
    for s in range(P):
        for kind, c, mb in pipeline_actions(P, s, M, V):
            v = c * P + s
            if kind == "F" and v < P * V - 1:
                sent.setdefault((s, (s + 1) % P), []).append(("F", v + 1, mb))
            if kind == "F" and v > 0:
                received.setdefault(((s - 1) % P, s), []).append(("F", v, mb))
            if kind == "B" and v > 0:
                sent.setdefault((s, (s - 1) % P), []).append(("B", v - 1, mb))
            if kind == "B" and v < P * V - 1:
                received.setdefault(((s + 1) % P, s), []).append(("B", v, mb))
    if sent != received:
        raise RuntimeError(f"pipeline schedule P={P} V={V} M={M}: send/receive orders differ")

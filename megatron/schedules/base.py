"""A pipeline schedule as one object, and the arithmetic every schedule shares.

With P stages, V model chunks per stage and M micro batches, stage s runs a list of actions
(kind, chunk, micro batch):

- 'F': the chunk's forward of the micro batch (its input received from the previous virtual
  stage, its output sent to the next);
- 'B': its backward to the input (the gradient sent to the previous virtual stage). When the
  list has no 'W' for the same (chunk, micro batch), this backward computes the weight
  gradients too (1F1B, interleaved);
- 'W': the weight gradients of a 'B' that ran earlier (zero-bubble schedules): nobody waits
  for them, so they fill the holes a stage would otherwise idle in.

Chunk c of stage s is virtual stage c P + s ("loop" placement), or, placed in a V (two chunks
per stage), s for chunk 0 and 2 P - 1 - s for chunk 1, so the first stage also holds the last
virtual stage. The training schedule (megatron.training.pipeline) runs the lists, the simulator
(megatron.schedules.sim) times them and proves them deadlock-free, the planner
(megatron.planning) walks them for a stage's activation peak and bubble, and the model
(megatron.model.stages) places its layers by the same virtual stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Action = tuple[str, int, int]
# (P, s, M, V) -> stage s's actions for one training step
Builder = Callable[[int, int, int, int], list[Action]]
# (P, M, V, costs) -> a stage's idle time per step in the papers (None: none published)
TextbookIdle = Callable[[int, int, int, object], "float | None"]


def virtual_stage(P: int, s: int, c: int = 0, v_shape: bool = False) -> int:
    """The virtual stage (0 .. P V - 1) that chunk c of stage s runs: c P + s (the loop), or
    with `v_shape` (two chunks) s and 2 P - 1 - s."""
    if v_shape:
        return s if c == 0 else 2 * P - 1 - s
    return c * P + s


def stage_of(P: int, v: int, v_shape: bool = False) -> tuple[int, int]:
    """(stage, chunk) running virtual stage v: the inverse of virtual_stage."""
    if v_shape:
        return (v, 0) if v < P else (2 * P - 1 - v, 1)
    return v % P, v // P


def forward_order(k: int, P: int, V: int) -> tuple[int, int]:
    """The k-th forward of a loop-placed stage: (chunk, micro batch), P micro batches per chunk
    in turn."""
    return (k // P) % V, (k // (P * V)) * P + k % P


@dataclass(frozen=True)
class PipelineSchedule:
    """One --pipeline-schedule value and everything the rest of the code asks of it.

    `chunks`: model chunks per rank (None: as many as --num-layers-per-virtual-pipeline-stage
    cuts a stage into, and at least two). `v_shape`: two chunks placed in a V. `split_backward`:
    its B's leave the weight gradients to a W (megatron.mpu.weight_grad). `overlaps_pairs`: its
    steady state pairs a forward with a full backward of the other chunk, which the runtime
    overlaps where MoE all-to-alls are there to hide (DualPipeV); `last_stage_alone`: how many of
    those pairs the last stage runs one half after the other, first to last (DualPipeV: one, as
    DeepSeek's reference does, so the V's bottom turns sooner). `whole_rounds`: it needs the
    micro batches per step in whole rounds of P. `help`: what the flag's help says of it.
    """

    name: str
    build: Builder
    help: str = ""
    chunks: int | None = 1
    v_shape: bool = False
    split_backward: bool = False
    overlaps_pairs: bool = False
    last_stage_alone: int = 0
    whole_rounds: bool = False
    textbook_idle: TextbookIdle | None = None

    def __str__(self) -> str:
        return self.name

    @property
    def fixed_chunks(self) -> int | None:
        """The chunks per rank the schedule itself sets, when more than one (the V's two)."""
        return self.chunks if (self.chunks or 1) > 1 else None

    def chunks_per_stage(self, V: int | None = None) -> int:
        """Chunks per stage: the schedule's own count, else V (1 when not given)."""
        return self.fixed_chunks or V or 1

    def model_chunks(self, layers_per_stage: int, layers_per_chunk: int | None) -> int | None:
        """Model chunks per pipeline rank (None: one, no virtual stages): the schedule's own
        count, or those of --num-layers-per-virtual-pipeline-stage layers."""
        if self.fixed_chunks or layers_per_chunk is None:
            return self.fixed_chunks
        return layers_per_stage // layers_per_chunk

    def virtual_stage(self, P: int, s: int, c: int) -> int:
        return virtual_stage(P, s, c, self.v_shape)

    def stage_of(self, P: int, v: int) -> tuple[int, int]:
        return stage_of(P, v, self.v_shape)

    def actions(
        self, P: int, s: int, M: int, V: int = 1, forward_only: bool = False
    ) -> list[Action]:
        """Stage s's action list (V: chunks per stage). `forward_only` (evaluation): every
        forward in virtual-stage order, nothing to overlap."""
        if not forward_only:
            return self.build(P, s, M, V)
        if self.v_shape:
            return [("F", c, mb) for mb in range(M) for c in (0, 1)]
        return [("F", *forward_order(k, P, V)) for k in range(M * V)]

    def overlapped_pairs(self, actions: list[Action], last_stage: bool = False) -> set[int]:
        """The steady-state pairs of a stage's `actions`: the indices i where actions[i] is a
        forward and actions[i + 1] a full backward (no W of its own) of the other chunk, which
        the runtime overlaps (megatron.mpu.overlap) once both their inputs arrived; on the
        `last_stage`, less its first `last_stage_alone`. Empty unless the schedule
        `overlaps_pairs`."""
        if not self.overlaps_pairs:
            return set()
        split = {(c, mb) for kind, c, mb in actions if kind == "W"}
        pairs = []
        for i in range(len(actions) - 1):
            (kind, c, _), (after, c2, mb2) = actions[i], actions[i + 1]
            if kind == "F" and after == "B" and c2 != c and (c2, mb2) not in split:
                pairs.append(i)
        return set(pairs[self.last_stage_alone if last_stage else 0 :])

    def start_line(self, P: int, M: int, V: int = 1, overlap: bool = False) -> str:
        """What the run's log says of its schedule at start: its name and shape and, for a
        schedule with pairs, how many each stage overlaps (`overlap`) or that they run in turn."""
        chunks = self.chunks_per_stage(V)
        v = " in a V" if self.v_shape else ""
        split = ", backward split into B and W" if self.split_backward else ""
        per = "chunk" if chunks == 1 else "chunks"
        line = (
            f"pipeline schedule: {self} ({P} stages x {chunks} {per}{v}, {M} micro batches{split})"
        )
        if not self.overlaps_pairs:
            return line
        if not overlap:
            return (
                f"{line}; its forward/backward pairs run in turn (overlapped only where MoE "
                "all-to-alls cross EP > 1 ranks, unless --no-overlap-moe-expert-parallel-comm)"
            )
        counts = [
            len(self.overlapped_pairs(self.actions(P, s, M, chunks), s == P - 1)) for s in range(P)
        ]
        n = self.last_stage_alone
        alone = f" (the last stage's first {n} run alone)" if n > 1 else ""
        alone = " (the last stage's first pair runs alone)" if n == 1 else alone
        return f"{line}; overlapped forward/backward pairs per stage: {counts}{alone}"

    def overlaps_moe_pairs(self, pp: int, ep: int, all_to_alls: bool = True) -> bool:
        """Whether the runtime overlaps this schedule's pairs: it has them, there are pipeline
        stages, and MoE tokens cross EP > 1 ranks by all-to-all (`all_to_alls`) to hide."""
        return self.overlaps_pairs and pp > 1 and ep > 1 and all_to_alls

    def messages(self, P: int, M: int, V: int = 1, forward_only: bool = False):
        """Per (sender, receiver) stage pair: the messages sent, and those received, in order.
        A message is ('F'|'B', receiving virtual stage, micro batch); a stage handing a tensor
        to itself (the V's bottom) sends nothing."""
        sent, received, last = {}, {}, P * V - 1
        for s in range(P):
            for kind, c, mb in self.actions(P, s, M, V, forward_only):
                v = self.virtual_stage(P, s, c)
                step = 1 if kind == "F" else -1  # where its output goes
                if (kind == "F" and v < last) or (kind == "B" and v > 0):
                    to = self.stage_of(P, v + step)[0]
                    if to != s:
                        sent.setdefault((s, to), []).append((kind, v + step, mb))
                if (kind == "F" and v > 0) or (kind == "B" and v < last):
                    frm = self.stage_of(P, v - step)[0]
                    if frm != s:
                        received.setdefault((frm, s), []).append((kind, v, mb))
        return sent, received

"""The rank grid and its process groups, built once and handed out as a value.

Ranks are laid out as `arange(world).reshape(PP, DP, CP, TP)`: TP is the fastest axis (TP peers
share a node and its fast links), then context parallelism (CP: each rank holds 2 of 2 x CP
chunks of every sequence), then DP, then PP, as in Megatron-core. Parameters are replicated over
DP and CP, so their gradients are reduced over the combined DP x CP group. `None` as a group
means "no group": a single process needs no torch.distributed at all.

Expert parallelism (EP, mixture of experts) is carved from the DP x CP ranks as in
Megatron-core (whose expert grid has no CP axis: its EP axis follows TP and takes in CP and DP):
the DP x CP index i = d x CP + c (CP inner) is i = e' x EP + e, so EP consecutive DP x CP ranks
(the EP group, index e; CP ranks of one sequence first) hold different experts and the
DP x CP / EP ranks with the same e (the expert-data-parallel group) hold the same experts and
average their gradients. At CP = 1 this is EP consecutive DP ranks.

Expert tensor parallelism (ETP, `--expert-tensor-parallel-size`) is 1 or TP: with ETP = TP each
expert's FFN is split over the TP group as the dense MLP is, so the ranks of one expert-data-
parallel group (same TP rank, same EP index) hold the same expert shard, and Megatron-core's
partition of a stage's TP x CP x DP ranks into ETP x EP x expert-DP is this one (ETP fastest,
then EP). With ETP = 1 the experts are replicated over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the TP x CP x DP x PP grid and the groups it belongs to."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    embedding_ranks: tuple[int, ...]
    tp_group: object | None = None
    pp_group: object | None = None
    dp_group: object | None = None
    mp_group: object | None = None  # TP x PP: every rank holding a piece of one model replica
    embedding_group: object | None = None  # first and last pipeline stage (tied embeddings)
    # The pipeline's point-to-point traffic, one group per direction (PP > 1): sends to a later
    # stage go through pp_up_group, to an earlier one through pp_down_group. Between two stages
    # each group then carries one direction only, so NCCL (whose sends block its stream until
    # the peer receives) never has both stages sending to each other on one stream: see
    # megatron/training/pipeline.py.
    pp_up_group: object | None = None
    pp_down_group: object | None = None
    virtual_pp_size: int | None = None
    # the V placement (ZBV, DualPipeV): the two chunks of stage s are virtual stages s and
    # 2 P - 1 - s (a V), so stage 0 holds the embedding, the head and the loss
    pipeline_v: bool = False
    # --sequence-parallel: between the TP regions activations hold s / tp positions per rank
    sequence_parallel: bool = False
    # --context-parallel-size: this rank holds chunks cp_rank and 2 cp - 1 - cp_rank of each
    # sequence; attention passes keys and values round cp_group (megatron/mpu/context_parallel.py)
    cp_size: int = 1
    cp_rank: int = 0
    cp_ranks: tuple[int, ...] = (0,)
    cp_group: object | None = None
    dp_cp_group: object | None = None  # DP x CP: every rank holding a replica of these weights
    # TP x CP: the ranks holding the tokens of one replica's micro batch (built when both > 1)
    tp_cp_group: object | None = None
    # --expert-model-parallel-size: EP consecutive DP x CP ranks split each MoE layer's experts
    ep_size: int = 1
    ep_rank: int = 0
    ep_ranks: tuple[int, ...] = (0,)
    ep_group: object | None = None
    expert_dp_group: object | None = None  # the DP x CP / EP ranks holding the same experts
    # --expert-tensor-parallel-size: 1 (experts replicated over TP) or tp_size (split over TP)
    etp_size: int = 1

    @property
    def etp_rank(self) -> int:
        return self.tp_rank if self.etp_size > 1 else 0

    @property
    def etp_group(self):
        """The group an expert's FFN is split over: the TP group at ETP = TP, else None."""
        return self.tp_group if self.etp_size > 1 else None

    @property
    def expert_dp_size(self) -> int:
        return self.dp_cp_size // self.ep_size

    @property
    def expert_data_group(self):
        """The group expert gradients are averaged over: DP x CP without expert parallelism."""
        return self.expert_dp_group if self.ep_size > 1 else self.dp_cp_group

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in dp_cp_group (its ranks in grid order: DP outer, CP inner)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def sequence_shards(self) -> int:
        """Ranks holding pieces of every sequence of a micro batch: CP, times TP under SP."""
        return self.cp_size * (self.tp_size if self.sequence_parallel else 1)

    @property
    def sequence_group(self):
        """The group of those `sequence_shards` ranks (None when it is this rank alone)."""
        if self.sequence_parallel:
            return self.tp_cp_group if self.cp_size > 1 else self.tp_group
        return self.cp_group if self.cp_size > 1 else None

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def loss_stage(self) -> int:
        """The pipeline stage holding the last virtual stage (the head and the loss)."""
        return 0 if self.pipeline_v else self.pp_size - 1

    @property
    def holds_loss(self) -> bool:
        return self.pp_rank == self.loss_stage

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (the one that reads data)."""
        return self.tp_ranks[0]

    @property
    def next_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks


def single_process_state() -> ParallelState:
    """The trivial layout (TP = PP = DP = 1) for one process, with no process groups."""
    return ParallelState(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        dp_size=1,
        tp_rank=0,
        pp_rank=0,
        dp_rank=0,
        tp_ranks=(0,),
        pp_ranks=(0,),
        dp_ranks=(0,),
        embedding_ranks=(0,),
    )


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> np.ndarray:
    """Global ranks as a [PP, DP, CP, TP] array; raises ValueError when the sizes do not
    divide the world."""
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * cp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-parallel {tp} x "
            f"context-parallel {cp} x pipeline-parallel {pp}; launch a multiple of "
            f"{tp * cp * pp} processes"
        )
    return np.arange(world_size).reshape(pp, world_size // (tp * cp * pp), cp, tp)


# The grid dimensions each kind of group spans (the others are fixed within one group).
_AXES = {
    "pp": (0,),
    "dp": (1,),
    "cp": (2,),
    "tp": (3,),
    "dp_cp": (1, 2),
    "tp_cp": (2, 3),
    "mp": (0, 3),
}


def _groups_along(grid: np.ndarray, axis: str) -> list[tuple[int, ...]]:
    """Every group of ranks that differ only along the dimensions `axis` names of the
    [PP, DP, CP, TP] grid ("mp": TP x PP of one (DP, CP) replica; "dp_cp": DP x CP)."""
    if axis not in _AXES:
        raise ValueError(f"unknown axis {axis!r}")
    spanned = _AXES[axis]
    fixed = [d for d in range(grid.ndim) if d not in spanned]
    moved = np.moveaxis(grid, fixed + list(spanned), range(grid.ndim))  # fixed dims first
    per_group = int(np.prod([grid.shape[d] for d in spanned]))
    return [tuple(int(r) for r in g) for g in moved.reshape(-1, per_group)]


def _expert_groups(grid: np.ndarray, ep: int) -> dict[str, list[tuple[int, ...]]]:
    """EP and expert-data-parallel groups: the [PP, DP, CP, TP] grid's DP and CP axes merged
    (CP inner) and viewed as [DP x CP / EP, EP] (EP fastest); "ep" spans EP, "expert_dp" the
    DP x CP / EP ranks with the same EP index."""
    pp, dp, cp, tp = grid.shape
    view = grid.reshape(pp, dp * cp // ep, ep, tp)  # [PP, DP x CP / EP, EP, TP]
    ep_groups = np.moveaxis(view, 2, -1).reshape(-1, ep)
    edp = np.moveaxis(view, 1, -1).reshape(-1, dp * cp // ep)
    return {
        "ep": [tuple(int(r) for r in g) for g in ep_groups],
        "expert_dp": [tuple(int(r) for r in g) for g in edp],
    }


def _embedding_ranks(pp_ranks: tuple[int, ...], pipeline_v: bool = False) -> tuple[int, ...]:
    """The stages holding the word embedding: the first and the last (the V: the first only,
    whose two chunks share one parameter)."""
    return (pp_ranks[0],) if len(pp_ranks) == 1 or pipeline_v else (pp_ranks[0], pp_ranks[-1])


def _my_groups(
    rank: int, groups_by_axis: dict, timeout
) -> dict[str, tuple[tuple[int, ...], object]]:
    """Create every group of every axis in order (all ranks together); keep the ones holding
    `rank`: axis -> (its ranks, the group)."""
    mine = {}
    for axis, groups in groups_by_axis.items():
        for ranks in groups:
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine[axis] = (ranks, group)
    return mine


def _embedding_group(grid, rank: int, pipeline_v: bool, timeout):
    """This rank's embedding ranks and, where it holds the embedding on more than one stage,
    the group that ties the copies."""
    emb_ranks: tuple[int, ...] = ()
    emb_group = None
    for ranks in _groups_along(grid, "pp"):
        e = _embedding_ranks(ranks, pipeline_v)
        group = dist.new_group(list(e), timeout=timeout)
        if rank in ranks:
            emb_ranks = e
            emb_group = group if rank in e and len(e) > 1 else None
    return emb_ranks, emb_group


def _direction_groups(grid, rank: int, timeout) -> dict[str, object]:
    """One pipeline group per direction ("up", "down"): see ParallelState.pp_up_group."""
    directions: dict[str, object] = {}
    for ranks in _groups_along(grid, "pp"):
        for direction in ("up", "down"):
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                directions[direction] = group
    return directions


def _check_expert_sizes(etp: int, tp: int, ep: int, dp: int, cp: int) -> None:
    if etp not in (1, tp):
        raise ValueError(
            f"expert-tensor-parallel size {etp} is neither 1 nor the tensor-parallel size {tp}"
        )
    if (dp * cp) % ep:
        raise ValueError(
            f"expert-parallel size {ep} does not divide the data-parallel x context-parallel "
            f"size {dp} x {cp}"
        )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout: timedelta | None = None,
    sequence_parallel: bool = False,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    pipeline_v: bool = False,
) -> ParallelState:
    """Build every process group from the rank grid; all ranks must call this together.

    torch.distributed must already be initialized. Groups are created in the same order on every
    rank (a requirement of `new_group`), and this rank keeps the ones it belongs to. `timeout`
    (the `--distributed-timeout-minutes` value) is given to every group: `new_group` does not
    inherit the default group's timeout, so without it a collective on a stopped peer waits
    torch's default 30 minutes. `sequence_parallel` is recorded for the model and the pipeline
    (it needs TP > 1: one rank has nothing to split the sequence over).
    `expert_tensor_parallel_size` is 1 or the TP size (the group is the TP group).
    `pipeline_v`: the V placement of the chunks (the ZBV and DualPipeV schedules).
    """
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed before building model-parallel groups")
    if sequence_parallel and tensor_model_parallel_size == 1:
        raise ValueError("sequence parallelism splits over the TP group: it needs TP > 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = context_parallel_size
    grid = rank_grid(world, tensor_model_parallel_size, pipeline_model_parallel_size, cp)
    axes = ["tp", "dp", "pp", "mp", "cp", "dp_cp"]
    if cp > 1 and tensor_model_parallel_size > 1:  # else it is the CP or the TP group
        axes.append("tp_cp")
    mine = _my_groups(rank, {axis: _groups_along(grid, axis) for axis in axes}, timeout)
    emb_ranks, emb_group = _embedding_group(grid, rank, pipeline_v, timeout)
    directions: dict[str, object] = {}
    if pipeline_model_parallel_size > 1:
        directions = _direction_groups(grid, rank, timeout)
    etp, ep = expert_tensor_parallel_size, expert_model_parallel_size
    _check_expert_sizes(etp, tensor_model_parallel_size, ep, grid.shape[1], cp)
    if ep > 1:
        mine.update(_my_groups(rank, _expert_groups(grid, ep), timeout))
    pp_idx, dp_idx, cp_idx, tp_idx = (int(i[0]) for i in np.nonzero(grid == rank))
    # each axis's ranks and group as ParallelState names them: tp_ranks, tp_group, ...
    ranks = {f"{axis}_ranks": mine[axis][0] for axis in ("tp", "pp", "dp", "cp")}
    groups = {f"{axis}_group": mine[axis][1] for axis in ("tp", "pp", "dp", "mp", "cp", "dp_cp")}
    return ParallelState(
        rank=rank,
        world_size=world,
        tp_size=tensor_model_parallel_size,
        pp_size=pipeline_model_parallel_size,
        dp_size=grid.shape[1],
        tp_rank=tp_idx,
        pp_rank=pp_idx,
        dp_rank=dp_idx,
        **ranks,
        **groups,
        embedding_ranks=emb_ranks,
        embedding_group=emb_group,
        pp_up_group=directions.get("up"),
        pp_down_group=directions.get("down"),
        virtual_pp_size=virtual_pipeline_model_parallel_size,
        pipeline_v=pipeline_v,
        sequence_parallel=sequence_parallel,
        cp_size=cp,
        cp_rank=cp_idx,
        tp_cp_group=mine["tp_cp"][1] if "tp_cp" in mine else None,
        ep_size=ep,
        ep_rank=(dp_idx * cp + cp_idx) % ep,
        ep_ranks=mine["ep"][0] if ep > 1 else (rank,),
        ep_group=mine["ep"][1] if ep > 1 else None,
        expert_dp_group=mine["expert_dp"][1] if ep > 1 else None,
        etp_size=etp,
    )


def destroy_model_parallel(state: ParallelState) -> None:
    """Destroy this state's groups. Nothing else holds them, so no state is left behind."""
    seen = set()
    for group in (
        state.tp_group,
        state.pp_group,
        state.dp_group,
        state.mp_group,
        state.embedding_group,
        state.pp_up_group,
        state.pp_down_group,
        state.cp_group,
        state.dp_cp_group,
        state.tp_cp_group,
        state.ep_group,
        state.expert_dp_group,
    ):
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            dist.destroy_process_group(group)

"""Resume on another layout: what this rank of the running model needs from a checkpoint saved
at another TP x PP (x virtual pipeline) layout, at any EP and ETP size
(megatron.checkpoint.reshard_load reads it; MoE experts are saved whole and each EP and ETP
rank keeps its own part), and the RNG streams such a resume starts with.

Data position: the samplers continue from the checkpoint's consumed-sample count, which does
not depend on the layout, so the run sees the uninterrupted run's sample sequence at any DP
size. RNG: with the same TP x PP shards every stream is restored exactly (state.resume); after
a TP or PP change no saved stream belongs to this rank (dropout draws differ per TP slice and
per stage), so every stream is re-seeded from --seed and the iteration, as initialize seeds
them at start-up: deterministic, and never a replay of the first iterations' masks.
"""

from __future__ import annotations

import dataclasses
import sys

from megatron.checkpoint.experts import expert_parameters
from megatron.checkpoint.reshard_load import (
    RankTarget,
    SavedLayout,
    SavedShards,
    read_rank_state,
)
from megatron.checkpoint.resharding import partition_record, split_rule
from megatron.checkpoint.rng_state import rng_state_dict
from megatron.config.schema import MegatronConfig
from megatron.initialize import Runtime, set_random_seeds
from megatron.model.families import vocab_sized_names
from megatron.mpu.expert_shards import is_etp_split


def rank_target(cfg: MegatronConfig, rt: Runtime, model) -> RankTarget:
    """This rank's tensors as the running model holds them (names, local shapes, TP splits,
    and which are MoE experts split over EP)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    experts = expert_parameters(model)
    return RankTarget(
        shapes=shapes,
        rules=partition_record(model),
        tp=rt.state.tp_size,
        tp_rank=rt.state.tp_rank,
        vocab_size=cfg.model.vocab_size,
        vocab_names=frozenset(vocab_sized_names()),
        experts=frozenset(experts),
        ep=rt.state.ep_size,
        ep_rank=rt.state.ep_rank,
        etp=rt.state.etp_size,
        etp_rank=rt.state.etp_rank,
        expert_splits={n: p.expert_partition for n, p in experts.items() if is_etp_split(p)},
    )


def open_checkpoint(cfg: MegatronConfig, root: str, iteration: int, saved: SavedLayout):
    """(the checkpoint's shards, opened lazily; its layout-free entries: args, counters, LR
    schedule, RNG, optimizer hyper-parameters, read from the first shard's pickle only)."""
    shards = SavedShards(root, iteration, saved, lambda name: split_rule(name, cfg.model))
    entries = {k: v for k, v in shards.file(0, 0).items() if k not in ("model", "partition")}
    return shards, entries


def read_resharded(
    cfg: MegatronConfig, rt: Runtime, model, shards: SavedShards, optim: bool
) -> tuple[dict, dict | None]:
    """(this rank's model state dict; its optimizer state in the distributed optimizer's
    checkpoint form, or None unless `optim`)."""
    return read_rank_state(shards, rank_target(cfg, rt, model), optim)


def reseeded_rng_state(cfg: MegatronConfig, rt: Runtime, iteration: int) -> dict:
    """Fresh streams for this rank after a TP / PP change: seeded as at start-up, from --seed
    plus the iteration. Returned as a checkpoint's rng_state (resume sets it)."""
    tracker = set_random_seeds(cfg.training.seed + iteration, rt.state, rt.device)
    state = rng_state_dict(rt.device)
    state["tracker"] = tracker.get_states()
    return state


def same_shard_changes(saved: SavedLayout, here: SavedLayout, with_optim: bool) -> list[str]:
    """What a resume from the same model shards changed ([]: nothing, or not recorded), for
    `announce`: DP / CP re-cut the distributed optimizer's ranges, EP re-cuts the experts
    (saved whole), and so does ETP. An older record without EP counts as this run's EP, one
    without ETP as ETP 1."""
    if saved.dp is None:
        return []
    if saved.ep is None:
        saved = dataclasses.replace(saved, ep=here.ep)
    if saved.etp is None:
        saved = dataclasses.replace(saved, etp=1 if here.etp is not None else None)
    if saved == here:
        return []
    what = ["same model shards"]
    if with_optim and (saved.dp, saved.cp) != (here.dp, here.cp):
        what.append("optimizer state re-cut over DP")
    if (saved.ep or 1) != (here.ep or 1):
        what.append(f"experts re-cut from EP{saved.ep or 1} to EP{here.ep or 1}")
    if (saved.etp or 1) != (here.etp or 1):
        what.append(f"experts re-cut from ETP{saved.etp or 1} to ETP{here.etp or 1}")
    return what


def announce(rt: Runtime, iteration: int, saved: SavedLayout, here: SavedLayout, what) -> None:
    """The one log line (rank 0) saying what a resume on another layout changed."""
    if rt.state.rank == 0:
        print(
            f" resharded checkpoint iteration {iteration} from {saved.describe()} to "
            f"{here.describe()}: {', '.join(what)}",
            file=sys.stderr,
        )

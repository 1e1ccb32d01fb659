"""Reshard on load: one rank's slices of a checkpoint saved at another TP x PP (x virtual
pipeline, x DP) layout, weights and optimizer state, read from the saved shards directly.

The layout record. Every checkpoint the trainer commits names, in its `complete` marker, the
layout its shards were written at ({"version": 1, "tensor_model_parallel_size": ...}, see
`layout_record`). A loader reads it before any shard: a record of a newer version than
LAYOUT_VERSION is refused (LayoutVersionError) rather than misread; checkpoints from before
the record get their TP x PP from the shard directories.

What a rank reads. A target rank knows its tensors (names, local shapes, and how each is
split: `RankTarget`, from its model). For a tensor split along dim d with stride s, the
indices of the full dim a TP rank holds are `shard(arange(L), 0, rank, size, s)` (the mpu's
own split applied to positions), so for every target position the saved TP rank and local
index holding it are known, and each saved piece is read with one `index_select`. Shards are
opened memory-mapped: a rank's reads touch only the pages of the slices it needs (whole rows
for dim-0 splits; a dim-1 split reads its columns' rows), never whole other stages. Vocab
tensors are padded per TP (V_pad depends on TP): rows past the real vocab are zeros, as at
initialization. MoE expert tensors are saved whole (all E experts, megatron.checkpoint.experts)
and replicated over TP; an EP rank reads its E / EP experts' rows of dim 0. Optimizer state
follows its parameter: every per-element tensor (Adam's moments, fp32 main weights) has the
parameter's shape and is cut the same way, whether it was saved by the plain optimizer (by
position in its parameter order, recorded as `param_names`) or by the distributed one (flat
ranges per DP rank, reassembled per TP-local parameter).
The result is in the distributed optimizer's checkpoint form (one range covering each
parameter; an expert tensor's range in the coordinates of the whole tensor, as that optimizer
saves it), which either optimizer loads (megatron.optim.shards).
Nothing here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.checkpoint.expert_bias import is_expert_bias, zero_bias
from megatron.checkpoint.experts import ENTRY_PLACES, saved_elements, whole_flat_index
from megatron.checkpoint.reading import load_shard, marker_files, marker_layout
from megatron.checkpoint.storage import (
    DISTRIB_OPTIM_NAME,
    SHARD_NAME,
    CheckpointError,
    checkpoint_dir,
)
from megatron.mpu.utils import shard

LAYOUT_VERSION = 1
Rule = tuple[int, int] | None  # (partition dim, stride), or None: every TP rank holds it all
_RANK_DIR = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?")


class LayoutVersionError(CheckpointError):
    """The checkpoint's layout record comes from a newer version of this code."""


@dataclass(frozen=True)
class SavedLayout:
    """The parallel layout a checkpoint was written at (None: not recorded)."""

    tp: int
    pp: int
    vp: int | None = None  # model chunks per pipeline stage (interleaved schedule)
    dp: int | None = None
    cp: int | None = None
    optimizer: str | None = None  # "plain" | "distributed" | None (no optimizer state)
    ep: int | None = None  # expert-parallel size (None: not recorded; experts are saved whole)
    etp: int | None = None  # expert-tensor-parallel size (None: not recorded, or 1)
    recorded: bool = True  # False: inferred from the shard directories (an older checkpoint)
    v_shape: bool = False  # the chunks placed in a V (the ZBV and DualPipeV schedules)

    def record(self) -> dict:
        v_shape = {"pipeline_v_shape": True} if self.v_shape else {}  # loop placements: as before
        return {
            "version": LAYOUT_VERSION,
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vp,
            "data_parallel_size": self.dp,
            "context_parallel_size": self.cp,
            "optimizer": self.optimizer,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        } | v_shape

    def describe(self) -> str:
        vp = f" (virtual {self.vp}{', in a V' if self.v_shape else ''})" if self.vp else ""
        dp = f" x DP{self.dp}" if self.dp else ""
        cp = f" x CP{self.cp}" if self.cp and self.cp > 1 else ""
        ep = f" x EP{self.ep}" if self.ep and self.ep > 1 else ""
        ep += f" x ETP{self.etp}" if self.etp and self.etp > 1 else ""
        opt = f", {self.optimizer} optimizer" if self.optimizer else ""
        return f"TP{self.tp} x PP{self.pp}{vp}{dp}{cp}{ep}{opt}"

    def same_shards(self, other: SavedLayout) -> bool:
        """Both write the same model shards (DP, CP and the optimizer kind aside); without a
        record the model chunks are unknown, and the caller compares the shard's names."""
        if (self.tp, self.pp) != (other.tp, other.pp):
            return False
        if self.recorded and other.recorded and self.v_shape != other.v_shape:
            return False
        return not (self.recorded and other.recorded) or (self.vp or 1) == (other.vp or 1)


def find_shard_layout(root: str, iteration: int) -> tuple[int, int]:
    """(TP, PP) from the mp_rank_* directories of a checkpoint."""
    directory = checkpoint_dir(root, iteration)
    ranks = []
    for name in os.listdir(directory):
        match = _RANK_DIR.fullmatch(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            ranks.append((int(match.group(1)), int(match.group(2) or 0)))
    if not ranks:
        raise CheckpointError(
            f"{directory} holds no mp_rank_*/model_optim_rng.pt shards (DeepSpeed engine "
            "checkpoints are not supported by the converter)"
        )
    return max(r[0] for r in ranks) + 1, max(r[1] for r in ranks) + 1


def read_layout(root: str, iteration: int) -> SavedLayout:
    """The layout `iteration` was saved at: its marker's record (checked against the shard
    files the marker lists), else its shard directories."""
    record = marker_layout(root, iteration)
    if record is None:
        return SavedLayout(*find_shard_layout(root, iteration), recorded=False)
    where = os.path.join(checkpoint_dir(root, iteration), "complete")
    version = record.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(
            f"{where}: its layout record's version is {version!r} ({type(version).__name__}), "
            f"not a version this code writes (the integer {LAYOUT_VERSION}): the marker was "
            f'edited or written by another tool. Fix: set "version": {LAYOUT_VERSION} there, '
            'or delete its "layout" entry to fall back to the shard directories'
        )
    if version > LAYOUT_VERSION:
        raise LayoutVersionError(
            f"{where} records checkpoint layout version {version}, but this code reads "
            f"versions up to {LAYOUT_VERSION}: the checkpoint was written by a newer version. "
            "Load it with that version (or convert it there with tools/convert_checkpoint.py)."
        )
    try:
        layout = SavedLayout(
            tp=int(record["tensor_model_parallel_size"]),
            pp=int(record["pipeline_model_parallel_size"]),
            vp=record.get("virtual_pipeline_model_parallel_size"),
            dp=record.get("data_parallel_size"),
            cp=record.get("context_parallel_size"),
            optimizer=record.get("optimizer"),
            ep=record.get("expert_model_parallel_size"),  # optional: added within version 1
            etp=record.get("expert_tensor_parallel_size"),  # likewise
            v_shape=bool(record.get("pipeline_v_shape", False)),  # likewise
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its layout record is malformed ({e!r})") from e
    _check_record_against_files(root, iteration, layout, where)
    return layout


def _check_record_against_files(root: str, iteration: int, layout: SavedLayout, where) -> None:
    """The record's TP x PP must be that of the mp_rank_* shard files the marker lists: a
    record that lies would cut every tensor wrong (a raw `size mismatch`, or worse)."""
    ranks, dirs = set(), []
    for rel in marker_files(root, iteration):
        match = _RANK_DIR.fullmatch(rel.split("/")[0])
        if match and rel.endswith("/" + SHARD_NAME):
            ranks.add((int(match.group(1)), int(match.group(2) or 0)))
            dirs.append(rel.split("/")[0])
    if not ranks:  # another library's layout (DeepSpeed's files): nothing to compare
        return
    tp, pp = max(r[0] for r in ranks) + 1, max(r[1] for r in ranks) + 1
    if (tp, pp) != (layout.tp, layout.pp) or len(ranks) != tp * pp:
        raise CheckpointError(
            f"{where}: its layout record says TP{layout.tp} x PP{layout.pp}, but the marker "
            f"lists the shards of {', '.join(dirs)} (TP{tp} x PP{pp}): the record was edited "
            f"or copied from another checkpoint. Fix: set tensor_model_parallel_size {tp} "
            f'and pipeline_model_parallel_size {pp} there, or delete its "layout" entry'
        )


@dataclass(frozen=True)
class RankTarget:
    """What one rank of the new layout holds: name -> local shape (model order), how each
    tensor is split over TP, and this rank's TP position; `vocab_size` is the real vocab.
    `experts`: the MoE expert tensors, saved whole (all E experts stacked along dim 0) and
    held here as EP rank `ep_rank`'s E / `ep` of them, those in `expert_splits` also cut
    along (dim, stride) to ETP rank `etp_rank`'s 1 / `etp` (never by the TP rules)."""

    shapes: dict[str, tuple[int, ...]]
    rules: dict[str, Rule]
    tp: int
    tp_rank: int
    vocab_size: int
    vocab_names: frozenset[str]
    experts: frozenset[str] = frozenset()
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    expert_splits: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def first_element(self, name: str) -> int:
        """Where this rank's flat tensor `name` starts in the flattened saved tensor: an
        expert tensor's slice in the whole one (the distributed optimizer's coordinates,
        megatron.checkpoint.experts.expert_offset), 0 for every other tensor."""
        if name not in self.experts:
            return 0
        return self.ep_rank * torch.Size(self.shapes[name]).numel()

    def whole_index(self, name: str) -> torch.Tensor | None:
        """For an expert tensor cut over ETP here: the whole tensor's flat index of each of
        its elements (megatron.checkpoint.experts.whole_index); else None."""
        split = self.expert_splits.get(name)
        if split is None:
            return None
        shape = self.shapes[name]
        n = torch.Size(shape).numel()
        return whole_flat_index(shape, split, self.ep_rank, self.etp, self.etp_rank, 0, n)

    def over_ep_only(self, name: str) -> RankTarget:
        """This target with expert tensor `name` whole over ETP (what `cut` reads before
        keeping this rank's ETP shard)."""
        dim = self.expert_splits[name][0]
        shape = list(self.shapes[name])
        shape[dim] *= self.etp
        splits = {n: v for n, v in self.expert_splits.items() if n != name}
        return dataclasses.replace(
            self, shapes={**self.shapes, name: tuple(shape)}, expert_splits=splits
        )


def _held(length: int, rule: Rule, size: int, rank: int) -> torch.Tensor:
    """(n,) indices of the full split dim that TP rank `rank` of `size` holds, local order."""
    if rule is None:
        return torch.arange(length)
    return shard(torch.arange(length), 0, rank, size, rule[1])


def cut(
    name: str,
    piece: Callable[[int], torch.Tensor],
    saved_rule: Rule,
    saved_tp: int,
    target: RankTarget,
    on_read: Callable[[int], None] = lambda k: None,
) -> torch.Tensor:
    """The target rank's local tensor `name`, read from the saved TP pieces (`piece(k)`: saved
    TP rank k's local tensor, memory-mapped), touching only the indices it needs; `on_read(k)`
    for each saved piece whose data it reads (piece(0)'s shape and dtype are metadata)."""
    if name in target.expert_splits:  # the EP rows whole over ETP, then this ETP shard
        whole = cut(name, piece, saved_rule, saved_tp, target.over_ep_only(name), on_read)
        dim, stride = target.expert_splits[name]
        return shard(whole, dim, target.etp_rank, target.etp, stride).contiguous()
    shape, rule = target.shapes[name], target.rules[name]
    first = piece(0)
    if saved_rule is not None and rule is not None and saved_rule[0] != rule[0]:
        raise CheckpointError(
            f"{name}: saved split along dim {saved_rule[0]}, this model splits it along "
            f"dim {rule[0]}; the model code changed in a way resharding cannot follow"
        )
    ep = target.ep if name in target.experts else 1
    if ep > 1 and (rule or saved_rule):
        raise CheckpointError(
            f"{name}: an expert tensor split over TP; resharding cuts experts over EP only"
        )
    dim = (rule or saved_rule or (0, 1))[0]  # experts: dim 0, the stacked experts
    saved_len = first.shape[dim] * (saved_tp if saved_rule else 1)
    target_len = shape[dim] * (target.tp if rule else 1) * ep
    real = target.vocab_size if name in target.vocab_names else saved_len
    other = [s for i, s in enumerate(shape) if i != dim]
    if (name not in target.vocab_names and saved_len != target_len) or other != [
        s for i, s in enumerate(first.shape) if i != dim
    ]:
        raise CheckpointError(
            f"{name}: the checkpoint holds {saved_len} along dim {dim} of "
            f"{tuple(first.shape)} per TP rank, this model needs {target_len} of {shape}; "
            "the model shape differs from the checkpoint's"
        )
    if ep > 1:  # EP rank r holds experts [r E / EP, (r + 1) E / EP)
        want = torch.arange(shape[0]) + target.ep_rank * shape[0]
    else:
        want = _held(target_len, rule, target.tp, target.tp_rank)
    owner = torch.full((saved_len,), -1, dtype=torch.long)
    local = torch.zeros(saved_len, dtype=torch.long)
    if saved_rule is None:  # every saved TP rank holds it: read the one this rank maps to
        owner[:], local = target.tp_rank * saved_tp // target.tp, torch.arange(saved_len)
    for k in range(saved_tp if saved_rule else 0):
        idx = _held(saved_len, saved_rule, saved_tp, k)
        owner[idx], local[idx] = k, torch.arange(len(idx))
    valid = want < min(real, saved_len)
    who = torch.where(valid, owner[want.clamp(max=saved_len - 1)], -1)
    out = torch.zeros(shape, dtype=first.dtype)  # vocab padding rows stay zero
    for k in who.unique().tolist():
        if k < 0:
            continue
        pos = (who == k).nonzero().squeeze(1)
        on_read(k)
        out.index_copy_(dim, pos, piece(k).index_select(dim, local[want[pos]]))
    return out


class SavedShards:
    """One saved checkpoint, its files opened memory-mapped on first use (checksums were
    verified by the ranks sharing that work: verify_checkpoint_files)."""

    def __init__(self, root: str, iteration: int, layout: SavedLayout, fallback_rules):
        self.root, self.iteration, self.layout = root, iteration, layout
        self._fallback_rules = fallback_rules  # name -> Rule, for shards without a record
        self._files: dict[tuple[int, int, str], dict] = {}
        self.read: set[tuple[int, int]] = set()  # (TP, PP) ranks whose tensor data was read

    def file(self, tp_rank: int, pp_rank: int, name: str = SHARD_NAME) -> dict:
        key = (tp_rank, pp_rank, name)
        if key not in self._files:
            self._files[key] = load_shard(
                self.root,
                self.iteration,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                pp_size=self.layout.pp,
                name=name,
                mmap=True,
                verify=False,
            )
        return self._files[key]

    @functools.cached_property
    def stage_of(self) -> dict[str, int]:
        """name -> the first saved pipeline stage that holds it (the tied word embedding's
        last-stage copy equals the first stage's)."""
        where: dict[str, int] = {}
        for p in range(self.layout.pp):
            for name in self.file(0, p)["model"]:
                where.setdefault(name, p)
        return where

    def rule(self, name: str) -> Rule:
        record = self.file(0, self.stage_of[name]).get("partition")
        if record is None:
            return self._fallback_rules(name)
        if name not in record:
            raise CheckpointError(
                f"{checkpoint_dir(self.root, self.iteration)}: no partition recorded for {name}"
            )
        return tuple(record[name]) if record[name] is not None else None

    def _stage(self, name: str) -> int:
        if name not in self.stage_of:
            raise CheckpointError(
                f"{checkpoint_dir(self.root, self.iteration)} holds no tensor {name} (saved at "
                f"{self.layout.describe()}); the model differs from the checkpoint's"
            )
        return self.stage_of[name]

    def _absent_bias(self, name: str) -> bool:
        """An expert bias this checkpoint was saved without (it starts at zero; module doc
        of megatron.checkpoint.expert_bias)."""
        return is_expert_bias(name) and name not in self.stage_of

    def weight(self, name: str, target: RankTarget) -> torch.Tensor:
        if self._absent_bias(name):
            return zero_bias(target.shapes[name])
        p = self._stage(name)
        return cut(
            name,
            lambda k: self.file(k, p)["model"][name],
            self.rule(name),
            self.layout.tp,
            target,
            lambda k: self.read.add((k, p)),
        )

    def optimizer_entry(self) -> dict | None:
        return self.file(0, 0).get("optimizer")

    @functools.cache  # noqa: B019 - one per checkpoint object, which lives for one load
    def _plain_index(self, tp_rank: int, pp_rank: int) -> dict[str, int]:
        """name -> position in the plain optimizer's state of one saved TP x PP rank."""
        shard_file = self.file(tp_rank, pp_rank)
        names = shard_file["optimizer"].get("param_names")
        if names is None:  # saved before the record: MegatronOptimizer's order (param_groups)
            model = shard_file["model"]
            names = [n for n in model if model[n].ndim > 1] + [
                n for n in model if model[n].ndim <= 1
            ]
        return {n: i for i, n in enumerate(names)}

    @functools.cache  # noqa: B019
    def _distributed_index(self, tp_rank: int, pp_rank: int) -> dict[str, list[dict]]:
        dp = self.file(tp_rank, pp_rank)["optimizer"]["dp_size"]
        index: dict[str, list[dict]] = {}
        for k in range(dp):
            f = self.file(tp_rank, pp_rank, DISTRIB_OPTIM_NAME.format(dp_rank=k))
            for name, entry in f["pieces"].items():
                index.setdefault(name, []).append(entry)
        return index

    def _local_state(self, tp_rank: int, pp_rank: int, name: str) -> dict[str, torch.Tensor]:
        """{state key: tensor shaped like the saved TP-local parameter, or a scalar}."""
        shard_file = self.file(tp_rank, pp_rank)
        shape = shard_file["model"][name].shape
        saved = shard_file["optimizer"]
        if not saved.get("distributed"):
            i = self._plain_index(tp_rank, pp_rank).get(name)
            if i is None:
                return {}
            out = dict(saved["optimizer"]["state"].get(i, {}))
            if saved.get("fp32_from_fp16_params") is not None:
                out["main"] = saved["fp32_from_fp16_params"][i]
            return out
        flat: dict[str, torch.Tensor] = {}
        covered = 0
        for entry in self._distributed_index(tp_rank, pp_rank).get(name, []):
            count, at = saved_elements(entry)  # a range, or (ETP-split experts) indices
            covered += count
            for key, value in entry.items():
                if key in ENTRY_PLACES:
                    continue
                if value.ndim == 0:
                    flat.setdefault(key, value)
                    continue
                dst = flat.setdefault(key, torch.zeros(shape.numel(), dtype=value.dtype))
                dst[at] = value
        if flat and covered != shape.numel():
            raise CheckpointError(
                f"{checkpoint_dir(self.root, self.iteration)}: the distributed optimizer files "
                f"of TP rank {tp_rank}, PP rank {pp_rank} cover {covered} of the "
                f"{shape.numel()} elements of {name}"
            )
        return {k: v.view(shape) if v.ndim else v for k, v in flat.items()}

    def optimizer_state(self, name: str, target: RankTarget) -> dict[str, torch.Tensor]:
        """{state key: the target rank's flat local tensor, or a scalar} for `name`."""
        if self._absent_bias(name):  # a buffer: no optimizer state
            return {}
        p, rule = self._stage(name), self.rule(name)
        per_rank = functools.cache(lambda k: self._local_state(k, p, name))
        out = {}
        for key, value in per_rank(0).items():
            if value.ndim == 0:
                out[key] = value.clone()
                continue
            piece = lambda k, key=key: per_rank(k)[key]  # noqa: E731
            local = cut(name, piece, rule, self.layout.tp, target, lambda k: self.read.add((k, p)))
            out[key] = local.reshape(-1)
        return out

    def shared_optimizer(self) -> dict:
        """The optimizer's non-per-element part in the distributed optimizer's form."""
        saved = self.optimizer_entry() or {}
        groups = saved["param_groups"] if saved.get("distributed") else None
        if groups is None:
            groups = saved["optimizer"]["param_groups"]
        shared = {"distributed": True, "dp_size": 1, "param_groups": groups}
        if "grad_scaler" in saved:
            shared["grad_scaler"] = saved["grad_scaler"]
        return shared


def read_rank_state(
    saved: SavedShards, target: RankTarget, with_optimizer: bool
) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(this rank's model state dict, its optimizer checkpoint in the distributed form:
    {"optimizer": shared part, "distrib_optim": [{"pieces": {name: {"range", state}}}]},
    or None without optimizer state)."""
    model = {name: saved.weight(name, target) for name in target.shapes}
    if not with_optimizer or saved.optimizer_entry() is None:
        return model, None
    pieces = {}
    for name, shape in target.shapes.items():
        state = saved.optimizer_state(name, target)
        index = target.whole_index(name)  # experts cut over ETP: element by element
        if index is not None:
            where = {"range": (int(index[0]), int(index[-1]) + 1), "index": index}
        else:
            lo = target.first_element(name)  # experts: this EP rank's range of the whole one
            where = {"range": (lo, lo + torch.Size(shape).numel())}
        pieces[name] = {**where, **state}
    optimizer = {"optimizer": saved.shared_optimizer(), "distrib_optim": [{"pieces": pieces}]}
    return model, optimizer

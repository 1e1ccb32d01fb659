"""Merge a TP x PP checkpoint into full tensors, and split full tensors for another layout.

A "full state" is the state dict of the TP = PP = 1 model with the vocab padding removed:
`embedding.word_embeddings.weight` (and an untied `head.output_layer.weight`) have exactly
`vocab_size` rows. The padded size is V_pad = ceil(V / (divisible_by x TP)) x divisible_by x TP,
so it depends on TP: merging drops the padding rows, splitting pads with zero rows again.

How a tensor is split is stated once, by the mpu layer that owns it (`partition_dim`,
`partition_stride` on the parameter). The trainer copies that into every shard it writes
(shard["partition"]: name -> (dim, stride), or None if replicated), and this module splits and
merges by that record. Shards without one (written before it existed, or a Hugging Face import)
get the same information from the model code itself: the TP = 1 model of the checkpoint's
arguments, built on the meta device (`model_layout`), which also gives the full shapes.
RNG state and the plain optimizer's state depend on the layout and are not converted (see
DROPPED_STATE_NOTE); the distributed optimizer's per-parameter state is merged and split like the
weights (megatron.checkpoint.optimizer_state).
Everything runs in one CPU process; nothing here touches torch.distributed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron.checkpoint import optimizer_state
from megatron.checkpoint.reading import load_shard, resolve_load_iteration
from megatron.checkpoint.reshard_load import SavedLayout, find_shard_layout
from megatron.checkpoint.storage import (
    CheckpointError,
    checkpoint_dir,
    finalize_checkpoint,
    save_shard,
)
from megatron.config.schema import ModelConfig, model_config_from_saved
from megatron.model import families as registry
from megatron.model.stages import stage_layer_range
from megatron.model.weights import WORD_EMBEDDINGS
from megatron.mpu.layers import partition_of
from megatron.mpu.utils import shard, unshard

POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
# Model families: a checkpoint's args["model_family"] (absent: the default family), or the one
# its tensor names tell (megatron.model.families asks each family).


def model_family(args: dict) -> str:
    return args.get("model_family", registry.DEFAULT_FAMILY)


def family_of_names(names) -> str:
    return registry.checkpoint_family(names)


def _build_tp1(cfg: ModelConfig, family: str) -> nn.Module:
    return registry.spec_of_checkpoint_family(family).reference_model(cfg, family)


def _is_vocab_sized(name: str) -> bool:
    """One row per vocab entry (padding rows dropped on merge, zeros restored on split)."""
    return name in registry.vocab_sized_names()


DROPPED_STATE_NOTE = (
    "note: the optimizer state (Adam moments, fp32 master weights, loss scale) and the RNG "
    "states were dropped: they depend on the TP/PP layout. Resume with --no-load-optim "
    "--no-load-rng (keeps the iteration and consumed samples; the optimizer starts fresh from "
    "the converted weights) or with --finetune (starts again at iteration 0)."
)
KEPT_OPTIMIZER_NOTE = (
    "note: the distributed optimizer's state (Adam moments, fp32 main weights, loss scale) was "
    "converted with the weights; the RNG states were dropped (they depend on the layout). "
    "Resume with --use-distributed-optimizer --no-load-rng (any DP size)."
)
# Shard entries that do not depend on the layout, carried over to the converted checkpoint.
_CARRIED = (
    "checkpoint_version",
    "consumed_train_samples",
    "consumed_valid_samples",
    "opt_param_scheduler",
)

Rule = tuple[int, int] | None  # (partition dim, stride), or None: every TP rank holds it all


def partition_record(model: nn.Module) -> dict[str, Rule]:
    """Name -> Rule of every tensor in `model`'s state dict (our DDP, ModelChunks or a
    a family's model), read from its parameters' mpu attributes: what a shard records."""
    module = getattr(model, "module", model)
    record: dict[str, Rule] = {}
    for chunk in getattr(module, "chunks", [module]):
        params = dict(chunk.named_parameters())
        for name in chunk.state_dict():
            record[name] = partition_of(params[name]) if name in params else None
    return record


@functools.lru_cache(maxsize=4)
def model_layout(
    cfg: ModelConfig, family: str = registry.DEFAULT_FAMILY
) -> tuple[dict[str, tuple[int, ...]], dict[str, Rule]]:
    """(full shapes, split rules) of every tensor of the model `cfg` describes, in model order.

    Read off the TP = 1 model built on the meta device (no memory, no weights drawn): the model
    code is the one statement of which tensors exist, their shapes and how they split.
    """
    with torch.device("meta"):
        model = _build_tp1(cfg, family)
    shapes = {}
    for name, tensor in model.state_dict().items():
        rows = cfg.vocab_size if _is_vocab_sized(name) else tensor.shape[0]
        shapes[name] = (rows, *tensor.shape[1:])
    return shapes, partition_record(model)


def split_rule(name: str, cfg: ModelConfig) -> Rule:
    """(partition dim, stride) of parameter `name` in the current model code, or None if every
    TP rank holds all of it: the rule for shards that carry no partition record."""
    return model_layout(cfg)[1].get(name)


def model_config(args: dict) -> ModelConfig:
    """The ModelConfig recorded in a shard's `args` (keys it no longer has are dropped)."""
    return model_config_from_saved(args["model"])


def full_shapes(
    cfg: ModelConfig, family: str = registry.DEFAULT_FAMILY
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the full state (unpadded vocab), in model order."""
    return dict(model_layout(cfg, family)[0])


def whole_model_args(cfg: ModelConfig, tokenizer: dict, params_dtype: torch.dtype) -> dict:
    """The args of a one-rank (TP = PP = 1) checkpoint of converted weights (HF, v1.x)."""
    return {
        "model": dataclasses.asdict(cfg),
        "tokenizer": tokenizer,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "padded_vocab_size": cfg.padded_vocab_size(1),
        "params_dtype": str(params_dtype),
    }


def check_full_state(
    full_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    where: str,
    family: str = registry.DEFAULT_FAMILY,
) -> None:
    """Raise CheckpointError unless `full_state` has exactly the model's names and shapes."""
    expected = full_shapes(cfg, family)
    missing = [n for n in expected if n not in full_state]
    extra = [n for n in full_state if n not in expected]
    wrong = [
        f"{n} {tuple(full_state[n].shape)} (expected {expected[n]})"
        for n in expected
        if n in full_state and tuple(full_state[n].shape) != expected[n]
    ]
    if missing or extra or wrong:
        problems = [
            f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
            for label, items in (("missing", missing), ("unexpected", extra), ("shape", wrong))
            if items
        ]
        raise CheckpointError(f"{where} does not match its model arguments; {'; '.join(problems)}")


def validate_layout(cfg: ModelConfig, tp: int, pp: int, vp_layers: int | None = None) -> None:
    """ValueError naming the flag if the model cannot be split into TP x PP (x virtual) pieces."""
    flag_tp, flag_pp = (
        "--target-tensor-model-parallel-size",
        "--target-pipeline-model-parallel-size",
    )
    if tp < 1 or pp < 1:
        raise ValueError(f"{flag_tp} and {flag_pp} must be >= 1, got {tp} and {pp}")
    for what, n in (
        ("--num-attention-heads", cfg.num_attention_heads),
        ("--num-query-groups", cfg.query_groups),
        ("--ffn-hidden-size", cfg.ffn_size),
    ):
        if n % tp:
            raise ValueError(f"{flag_tp} {tp} does not divide the model's {what} ({n})")
    if cfg.num_layers % pp:
        raise ValueError(
            f"{flag_pp} {pp} does not divide the model's --num-layers ({cfg.num_layers})"
        )
    if vp_layers is not None and (vp_layers < 1 or (cfg.num_layers // pp) % vp_layers):
        raise ValueError(
            f"--target-num-layers-per-virtual-pipeline-stage {vp_layers} does not divide the "
            f"{cfg.num_layers // pp} layers of each pipeline stage"
        )


def stage_names(
    cfg: ModelConfig,
    pp: int,
    pp_rank: int,
    vp_layers: int | None = None,
    family: str = registry.DEFAULT_FAMILY,
) -> list[str]:
    """Names of the full state a pipeline rank holds (its model chunks' union), model order.

    The last stage of a PP > 1 model with tied embeddings or multi-token prediction also holds
    the word embedding (the copy its output layer multiplies with, or MTP embeds with); the
    MTP modules (`mtp.*`) live on the last stage.
    """
    vp = (cfg.num_layers // pp) // vp_layers if vp_layers else None
    layers = {
        i for c in range(vp or 1) for i in stage_layer_range(cfg.num_layers, pp, pp_rank, vp, c)
    }
    first, last = pp_rank == 0, pp_rank == pp - 1
    shared = not cfg.untie_embeddings_and_output_weights or cfg.mtp_num_layers is not None
    names = []
    for name in full_shapes(cfg, family):
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in layers
        elif name == WORD_EMBEDDINGS:
            keep = first or (last and shared)
        elif name.startswith("embedding."):
            keep = first
        else:  # head.*, mtp.*
            keep = last
        if keep:
            names.append(name)
    return names


@dataclass
class LoadedCheckpoint:
    """A checkpoint merged to one full state, with what a converted shard carries over."""

    state: dict[str, torch.Tensor]
    args: dict
    iteration: int
    meta: dict = field(default_factory=dict)  # the _CARRIED entries of the first shard
    tp: int = 1
    pp: int = 1
    # The distributed optimizer's state: {"full": {key: full state like `state`}, "step":
    # {name: scalar}, "shared": the model shard's optimizer entry}; None if not converted.
    optimizer: dict | None = None


def _merge_tp(name: str, pieces: list[torch.Tensor], rule: Rule) -> torch.Tensor:
    if rule is not None:
        return unshard(pieces, rule[0], rule[1])
    if any(p.shape != pieces[0].shape for p in pieces):
        raise CheckpointError(f"{name}: TP ranks hold different shapes, but it is not TP-split")
    if not all(torch.equal(p, pieces[0]) for p in pieces[1:]):
        warnings.warn(f"{name} differs between TP ranks; keeping TP rank 0's copy", stacklevel=4)
    return pieces[0]


def stage_rules(shards: list[dict], cfg: ModelConfig, where: str) -> dict[str, Rule]:
    """How the tensors of one stage's TP shards are split: their partition record, or for
    shards written before it existed, the current model code's rules (split_rule)."""
    names = list(shards[0]["model"])
    if any(list(s["model"]) != names for s in shards[1:]):
        raise CheckpointError(f"{where}: its TP shards hold different tensor names")
    records = [s.get("partition") for s in shards]
    if records[0] is None:
        return {n: split_rule(n, cfg) for n in names}
    if any(r != records[0] for r in records[1:]):
        raise CheckpointError(f"{where}: its TP shards record different partitions")
    unrecorded = [n for n in names if n not in records[0]]
    if unrecorded:
        raise CheckpointError(f"{where}: no partition recorded for {', '.join(unrecorded[:4])}")
    return {n: tuple(r) if r is not None else None for n, r in records[0].items()}


def _merge_stage(shards: list[dict], cfg: ModelConfig, where: str, full: dict) -> None:
    """Merge one pipeline stage's TP shards into `full` (the vocab padding dropped)."""
    rules = stage_rules(shards, cfg, where)
    for name in shards[0]["model"]:
        tensor = _merge_tp(name, [s["model"][name] for s in shards], rules[name])
        if _is_vocab_sized(name):
            tensor = tensor[: cfg.vocab_size].clone()  # drop the padding rows
        if name in full:  # the last stage's copy of the tied word embedding
            if not torch.equal(full[name], tensor):
                warnings.warn(
                    f"{name}: the last stage's tied copy differs from the first stage's; "
                    "keeping the first stage's",
                    stacklevel=3,
                )
            continue
        full[name] = tensor


def load_checkpoint(load_dir: str, iteration: int | None = None, progress=None) -> LoadedCheckpoint:
    """Read every shard of a checkpoint (any TP x PP) and merge it into one full state.
    `progress(stages done, stages)` is called after each pipeline stage."""
    it = resolve_load_iteration(load_dir, iteration=iteration)
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint")
    tp, pp = find_shard_layout(load_dir, it)
    directory = checkpoint_dir(load_dir, it)
    full: dict[str, torch.Tensor] = {}
    args = meta = optimizer = None
    for pp_rank in range(pp):
        shards = [
            load_shard(load_dir, it, tp_rank=r, pp_rank=pp_rank, pp_size=pp) for r in range(tp)
        ]
        if args is None:
            args = shards[0]["args"]
            meta = {k: shards[0][k] for k in _CARRIED if k in shards[0]}
            saved = (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"])
            if saved != (tp, pp):
                raise CheckpointError(
                    f"{directory}: its args say TP={saved[0]} x PP={saved[1]}"
                    f" but it holds shards for TP={tp} x PP={pp}"
                )
            cfg = model_config(args)
        _merge_stage(shards, cfg, f"{directory} PP stage {pp_rank}", full)
        if optimizer is not None or (pp_rank == 0 and optimizer_state.is_distributed(shards[0])):
            optimizer = optimizer or {"full": {}, "step": {}, "shared": shards[0]["optimizer"]}
            _merge_optimizer(load_dir, it, shards, cfg, pp_rank, pp, optimizer)
        del shards
        if progress:
            progress(pp_rank + 1, pp)
    family = family_of_names(full)
    if family != registry.DEFAULT_FAMILY:
        args = {**args, "model_family": family}
    check_full_state(full, cfg, directory, family)
    full = {n: full[n] for n in full_shapes(cfg, family)}  # model order, whatever the stage order
    if optimizer is not None:
        optimizer["shared"] = optimizer_state.shared_entry(optimizer["shared"])
    return LoadedCheckpoint(full, args, it, meta, tp, pp, optimizer)


def _merge_optimizer(root, it, shards, cfg, pp_rank, pp, optimizer) -> None:
    """Merge one stage's distributed optimizer state over TP into optimizer["full"]."""
    per_tp = [
        optimizer_state.read_rank_state(root, it, s, tp_rank=r, pp_rank=pp_rank, pp_size=pp)
        for r, s in enumerate(shards)
    ]
    optimizer["step"].update(per_tp[0].pop("step", {}))
    for key in per_tp[0]:
        pieces = [
            {"model": st[key], "partition": s.get("partition")}
            for st, s in zip(per_tp, shards, strict=True)
        ]
        where = f"{checkpoint_dir(root, it)} PP stage {pp_rank} optimizer {key}"
        _merge_stage(pieces, cfg, where, optimizer["full"].setdefault(key, {}))


def load_full_state(load_dir: str, iteration: int | None = None) -> tuple[dict, dict]:
    """(full state dict with the vocab padding removed, the checkpoint's args)."""
    loaded = load_checkpoint(load_dir, iteration)
    return loaded.state, loaded.args


def _local_tensor(
    name: str, full: torch.Tensor, rule: Rule, tp: int, tp_rank: int, padded: int
) -> torch.Tensor:
    if _is_vocab_sized(name):
        pad = full.new_zeros(padded - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])  # (V_pad, h): padding rows are zeros, as at init
    if rule is None:
        return full.clone()
    return shard(full, rule[0], tp_rank, tp, rule[1]).contiguous()


def write_layout(
    args: dict,
    save_dir: str,
    tp: int,
    pp: int,
    iteration: int,
    rank_state,
    meta: dict | None = None,
    vp_layers: int | None = None,
    progress=None,
) -> bool:
    """Write a complete TP x PP checkpoint whose ranks' tensors `rank_state(names, tp_rank,
    padded vocab)` gives: (model state, optimizer state {key: {name: tensor}} or None, the
    shared optimizer entry or None). The shards record their partition and the layout; the
    optimizer state is written as the distributed optimizer's, DP rank 0 of 1. True if it was.
    """
    cfg, family = model_config(args), model_family(args)
    padded = cfg.padded_vocab_size(tp)
    new_args = copy.deepcopy(args)
    new_args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, padded_vocab_size=padded
    )
    meta = meta or {}
    rules = model_layout(cfg, family)[1]
    with_optimizer = False
    for pp_rank in range(pp):
        names = stage_names(cfg, pp, pp_rank, vp_layers, family)
        for tp_rank in range(tp):
            model, local, shared = rank_state(names, tp_rank, padded)
            shard_state = {
                "checkpoint_version": meta.get("checkpoint_version", 3.0),
                "iteration": iteration,
                "consumed_train_samples": meta.get("consumed_train_samples", 0),
                "consumed_valid_samples": meta.get("consumed_valid_samples", 0),
                "model": model,
                "partition": {n: rules[n] for n in names},
                "args": new_args,
            }
            if "opt_param_scheduler" in meta:
                shard_state["opt_param_scheduler"] = meta["opt_param_scheduler"]
            where = {"tp_rank": tp_rank, "pp_rank": pp_rank, "pp_size": pp}
            if local is not None:
                optimizer_state.write_rank_state(save_dir, iteration, local, **where)
                shard_state["optimizer"] = shared
                with_optimizer = True
            save_shard(save_dir, iteration, shard_state, write=True, **where)
            if progress:
                progress(pp_rank * tp + tp_rank + 1, tp * pp)
    files = tp * pp * (2 if with_optimizer else 1)
    vp = (cfg.num_layers // pp) // vp_layers if vp_layers else None
    kind = "distributed" if with_optimizer else None
    layout = SavedLayout(tp, pp, vp, dp=1, cp=1, optimizer=kind, ep=1)
    finalize_checkpoint(
        save_dir,
        iteration,
        barrier=lambda: None,
        is_rank0=True,
        num_shards_expected=files,
        layout_record=layout.record(),
    )
    return with_optimizer


def save_resharded(
    full_state: dict[str, torch.Tensor],
    args: dict,
    save_dir: str,
    tp: int,
    pp: int,
    iteration: int,
    *,
    meta: dict | None = None,
    vp_layers: int | None = None,
    quiet: bool = False,
    optimizer: dict | None = None,
    progress=None,
) -> None:
    """Write `full_state` as a complete TP x PP checkpoint at `iteration` of `save_dir`.

    Tensors are split as the current model code splits them (the trainer loads the shards
    straight into its parameters), and each shard records that partition, as the trainer's
    own shards do. `meta` carries iteration-independent extras over (consumed samples, the LR
    schedule, which does not depend on the layout). `vp_layers` lays stages out for
    --num-layers-per-virtual-pipeline-stage. The RNG state is not written, nor the optimizer
    state unless `optimizer` (LoadedCheckpoint.optimizer) gives the distributed optimizer's.
    `progress(shards written, shards)` is called after each shard.
    """
    cfg, family = model_config(args), model_family(args)
    validate_layout(cfg, tp, pp, vp_layers)
    check_full_state(full_state, cfg, "the state to save", family)
    target = checkpoint_dir(save_dir, iteration)
    if os.path.exists(target):
        raise ValueError(f"--save {save_dir}: {target} already exists; pick an empty directory")
    rules = model_layout(cfg, family)[1]

    def rank_state(names: list[str], tp_rank: int, padded: int):
        model = {n: _local_tensor(n, full_state[n], rules[n], tp, tp_rank, padded) for n in names}
        if optimizer is None:
            return model, None, None
        local = {
            key: {
                n: _local_tensor(n, full[n], rules[n], tp, tp_rank, padded)
                for n in names
                if n in full
            }
            for key, full in optimizer["full"].items()
        }
        local["step"] = {n: t for n, t in optimizer["step"].items() if n in names}
        return model, local, optimizer["shared"]

    write_layout(args, save_dir, tp, pp, iteration, rank_state, meta, vp_layers, progress)
    if not quiet:
        print(KEPT_OPTIMIZER_NOTE if optimizer else DROPPED_STATE_NOTE, file=sys.stderr)

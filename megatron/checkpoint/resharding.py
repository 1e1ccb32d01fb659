"""Merge a TP x PP checkpoint into full tensors, and split full tensors for another layout.

A "full state" is the state dict of the TP = PP = 1 model with the vocab padding removed:
`embedding.word_embeddings.weight` (and an untied `head.output_layer.weight`) have exactly
`vocab_size` rows. The padded size is V_pad = ceil(V / (divisible_by x TP)) x divisible_by x TP,
so it depends on TP: merging drops the padding rows, splitting pads with zero rows again.

The shard files do not record how a tensor is split (the mpu attributes `partition_dim` and
`partition_stride` live on the parameters), so `split_rule` derives it from the name.
Optimizer and RNG state depend on the layout and are not converted (see DROPPED_STATE_NOTE).
Everything runs in one CPU process; nothing here touches torch.distributed.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch

from megatron.checkpoint.storage import (
    CheckpointError,
    checkpoint_dir,
    finalize_checkpoint,
    load_shard,
    resolve_load_iteration,
    save_shard,
)
from megatron.config.schema import ModelConfig, model_config_from_saved
from megatron.model.gpt import OUTPUT_WEIGHTS, WORD_EMBEDDINGS
from megatron.model.stages import stage_layer_range
from megatron.mpu.utils import shard, unshard

POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
VOCAB_WEIGHTS = (WORD_EMBEDDINGS, OUTPUT_WEIGHTS)
DROPPED_STATE_NOTE = (
    "note: the optimizer state (Adam moments, fp32 master weights, loss scale) and the RNG "
    "states were dropped: they depend on the TP/PP layout. Resume with --no-load-optim "
    "--no-load-rng (keeps the iteration and consumed samples; the optimizer starts fresh from "
    "the converted weights) or with --finetune (starts again at iteration 0)."
)
# Shard entries that do not depend on the layout, carried over to the converted checkpoint.
_CARRIED = (
    "checkpoint_version",
    "consumed_train_samples",
    "consumed_valid_samples",
    "opt_param_scheduler",
)
_RANK_DIR = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?")

# Parameter name (after `layers.{i}.` for layer parameters) -> (partition dim, stride);
# names absent from the table are replicated on every TP rank. None: SwiGLU decides.
_SPLIT_TABLE: dict[str, tuple[int, int | None]] = {
    WORD_EMBEDDINGS: (0, 1),  # VocabParallelEmbedding: vocab rows
    OUTPUT_WEIGHTS: (0, 1),  # ColumnParallelLinear over the vocab
    "self_attention.query_key_value.weight": (0, 1),  # whole query groups per rank
    "self_attention.query_key_value.bias": (0, 1),
    "self_attention.dense.weight": (1, 1),  # RowParallelLinear: input columns
    "mlp.dense_h_to_4h.weight": (0, None),  # [gate; up] with SwiGLU: stride 2
    "mlp.dense_h_to_4h.bias": (0, None),
    "mlp.dense_4h_to_h.weight": (1, 1),
}


def split_rule(name: str, cfg: ModelConfig) -> tuple[int, int] | None:
    """(partition dim, stride) of parameter `name`, or None if every TP rank holds all of it."""
    key = name.split(".", 2)[2] if name.startswith("layers.") else name
    rule = _SPLIT_TABLE.get(key)
    if rule is None:
        return None
    dim, stride = rule
    return dim, stride if stride is not None else (2 if cfg.swiglu else 1)


def model_config(args: dict) -> ModelConfig:
    """The ModelConfig recorded in a shard's `args` (keys it no longer has are dropped)."""
    return model_config_from_saved(args["model"])


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the full state (unpadded vocab), in model order."""
    h, v, ffn = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
    norm = ("weight",) if cfg.normalization == "RMSNorm" else ("weight", "bias")
    linear = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    shapes: dict[str, tuple[int, ...]] = {WORD_EMBEDDINGS: (v, h)}
    if cfg.position_embedding_type == "learned":
        shapes[POSITION_EMBEDDINGS] = (cfg.max_positions, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        blocks = (
            ("input_layernorm", norm, h, None),
            ("self_attention.query_key_value", linear, qkv, h),
            ("self_attention.dense", linear, h, cfg.num_attention_heads * cfg.head_dim),
            ("post_attention_layernorm", norm, h, None),
            ("mlp.dense_h_to_4h", linear, ffn * (2 if cfg.swiglu else 1), h),
            ("mlp.dense_4h_to_h", linear, h, ffn),
        )
        for module, params, rows, cols in blocks:
            for param in params:
                is_matrix = param == "weight" and cols is not None
                shapes[f"{p}{module}.{param}"] = (rows, cols) if is_matrix else (rows,)
    for param in norm:
        shapes[f"head.final_layernorm.{param}"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        shapes[OUTPUT_WEIGHTS] = (v, h)
    return shapes


def check_full_state(full_state: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> None:
    """Raise CheckpointError unless `full_state` has exactly the model's names and shapes."""
    expected = full_shapes(cfg)
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


def stage_names(cfg: ModelConfig, pp: int, pp_rank: int, vp_layers: int | None = None) -> list[str]:
    """Names of the full state a pipeline rank holds (its model chunks' union), model order.

    The last stage of a PP > 1 model with tied embeddings also holds the word embedding (the
    copy its output layer multiplies with).
    """
    vp = (cfg.num_layers // pp) // vp_layers if vp_layers else None
    layers = {
        i for c in range(vp or 1) for i in stage_layer_range(cfg.num_layers, pp, pp_rank, vp, c)
    }
    first, last = pp_rank == 0, pp_rank == pp - 1
    tied = not cfg.untie_embeddings_and_output_weights
    names = []
    for name in full_shapes(cfg):
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) in layers
        elif name == WORD_EMBEDDINGS:
            keep = first or (last and tied)
        elif name.startswith("embedding."):
            keep = first
        else:  # head.*
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


def _find_layout(root: str, iteration: int) -> tuple[int, int]:
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


def _merge_tp(name: str, pieces: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    rule = split_rule(name, cfg)
    if rule is not None:
        return unshard(pieces, rule[0], rule[1])
    if any(p.shape != pieces[0].shape for p in pieces):
        raise CheckpointError(f"{name}: TP ranks hold different shapes, but it is not TP-split")
    if not all(torch.equal(p, pieces[0]) for p in pieces[1:]):
        warnings.warn(f"{name} differs between TP ranks; keeping TP rank 0's copy", stacklevel=3)
    return pieces[0]


def load_checkpoint(load_dir: str, iteration: int | None = None) -> LoadedCheckpoint:
    """Read every shard of a checkpoint (any TP x PP) and merge it into one full state."""
    it = resolve_load_iteration(load_dir, iteration=iteration)
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint")
    tp, pp = _find_layout(load_dir, it)
    full: dict[str, torch.Tensor] = {}
    args = meta = None
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
                    f"{checkpoint_dir(load_dir, it)}: its args say TP={saved[0]} x PP={saved[1]}"
                    f" but it holds shards for TP={tp} x PP={pp}"
                )
            cfg = model_config(args)
        names = list(shards[0]["model"])
        if any(list(s["model"]) != names for s in shards[1:]):
            raise CheckpointError(f"TP shards of PP stage {pp_rank} hold different tensor names")
        for name in names:
            tensor = _merge_tp(name, [s["model"][name] for s in shards], cfg)
            if name in VOCAB_WEIGHTS:
                tensor = tensor[: cfg.vocab_size].clone()  # drop the padding rows
            if name in full:  # the last stage's copy of the tied word embedding
                if not torch.equal(full[name], tensor):
                    warnings.warn(
                        f"{name}: the last stage's tied copy differs from the first stage's; "
                        "keeping the first stage's",
                        stacklevel=2,
                    )
                continue
            full[name] = tensor
        del shards
    check_full_state(full, cfg, checkpoint_dir(load_dir, it))
    full = {n: full[n] for n in full_shapes(cfg)}  # model order, whatever the stage order
    return LoadedCheckpoint(full, args, it, meta, tp, pp)


def load_full_state(load_dir: str, iteration: int | None = None) -> tuple[dict, dict]:
    """(full state dict with the vocab padding removed, the checkpoint's args)."""
    loaded = load_checkpoint(load_dir, iteration)
    return loaded.state, loaded.args


def _local_tensor(
    name: str, full: torch.Tensor, cfg: ModelConfig, tp: int, tp_rank: int, padded: int
) -> torch.Tensor:
    if name in VOCAB_WEIGHTS:
        pad = full.new_zeros(padded - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])  # (V_pad, h): padding rows are zeros, as at init
    rule = split_rule(name, cfg)
    if rule is None:
        return full.clone()
    return shard(full, rule[0], tp_rank, tp, rule[1]).contiguous()


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
) -> None:
    """Write `full_state` as a complete TP x PP checkpoint at `iteration` of `save_dir`.

    `meta` carries iteration-independent extras over (consumed samples, the LR schedule, which
    does not depend on the layout). `vp_layers` lays stages out for
    --num-layers-per-virtual-pipeline-stage. The optimizer and RNG state are not written.
    """
    cfg = model_config(args)
    validate_layout(cfg, tp, pp, vp_layers)
    check_full_state(full_state, cfg, "the state to save")
    target = checkpoint_dir(save_dir, iteration)
    if os.path.exists(target):
        raise ValueError(f"--save {save_dir}: {target} already exists; pick an empty directory")
    padded = cfg.padded_vocab_size(tp)
    new_args = copy.deepcopy(args)
    new_args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, padded_vocab_size=padded
    )
    meta = meta or {}
    for pp_rank in range(pp):
        names = stage_names(cfg, pp, pp_rank, vp_layers)
        for tp_rank in range(tp):
            model = {n: _local_tensor(n, full_state[n], cfg, tp, tp_rank, padded) for n in names}
            shard_state = {
                "checkpoint_version": meta.get("checkpoint_version", 3.0),
                "iteration": iteration,
                "consumed_train_samples": meta.get("consumed_train_samples", 0),
                "consumed_valid_samples": meta.get("consumed_valid_samples", 0),
                "model": model,
                "args": new_args,
            }
            if "opt_param_scheduler" in meta:
                shard_state["opt_param_scheduler"] = meta["opt_param_scheduler"]
            save_shard(
                save_dir,
                iteration,
                shard_state,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                pp_size=pp,
                write=True,
            )
    finalize_checkpoint(
        save_dir, iteration, barrier=lambda: None, is_rank0=True, num_shards_expected=tp * pp
    )
    if not quiet:
        print(DROPPED_STATE_NOTE, file=sys.stderr)

"""tools/convert_checkpoint.py --load/--save: another TP x PP layout, offline, with the code
the trainer reshards on load with (megatron.checkpoint.reshard_load).

Each target shard is cut straight from the saved shards (memory-mapped), one at a time, so the
converter holds one target rank's state, never the whole model. The optimizer state of either
kind is converted with the weights and written as the distributed optimizer's (DP rank 0 of 1),
which both optimizers load at any DP size; the RNG states are not (a new layout re-seeds them).
"""

from __future__ import annotations

import os

from megatron.checkpoint.reading import resolve_load_iteration, verify_checkpoint_files
from megatron.checkpoint.reshard_load import RankTarget, SavedShards, read_layout, read_rank_state
from megatron.checkpoint.resharding import (
    _CARRIED,
    family_of_names,
    model_config,
    model_layout,
    split_rule,
    validate_layout,
    write_layout,
)
from megatron.checkpoint.storage import CheckpointError, checkpoint_dir
from megatron.model.families import vocab_sized_names

CONVERTED_NOTE = (
    "note: the optimizer state (Adam moments, fp32 main weights, loss scale) was converted "
    "with the weights; the RNG states were not (they depend on the layout): resume with "
    "--no-load-rng, or let --load re-seed them. (--load of the original works too: the "
    "trainer reshards on load.)"
)
NO_OPTIMIZER_NOTE = (
    "note: no optimizer state was converted (the checkpoint holds none, or none in a form that "
    "can be resharded); resume with --no-load-optim --no-load-rng (keeps the iteration and "
    "consumed samples) or with --finetune (starts again at iteration 0)."
)


def _local_shape(full: tuple[int, ...], rule, tp: int, padded: int, vocab: bool):
    shape = list(full)
    if vocab:
        shape[0] = padded
    if rule is not None:
        shape[rule[0]] //= tp
    return tuple(shape)


def convert_layout(
    load_dir: str,
    save_dir: str,
    tp: int | None = None,
    pp: int | None = None,
    vp_layers: int | None = None,
    iteration: int | None = None,
    progress=None,
) -> dict:
    """Write `load_dir`'s checkpoint (the latest complete one, or `iteration`) to `save_dir` at
    TP x PP (default: the saved sizes). Returns what was done: iteration, the saved and
    written layouts, padded vocab sizes, whether optimizer state was converted, the note."""
    it = resolve_load_iteration(load_dir, iteration=iteration)
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint")
    saved = read_layout(load_dir, it)
    verify_checkpoint_files(load_dir, it)  # one process: it checks every file
    shards = SavedShards(load_dir, it, saved, None)
    first = shards.file(0, 0)
    args = first["args"]
    recorded = (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"])
    if recorded != (saved.tp, saved.pp):
        raise CheckpointError(
            f"{checkpoint_dir(load_dir, it)}: its args say TP={recorded[0]} x PP={recorded[1]}"
            f" but it holds shards for TP={saved.tp} x PP={saved.pp}"
        )
    cfg = model_config(args)
    family = family_of_names(shards.stage_of)
    if family != "gpt":
        args = {**args, "model_family": family}
    shards._fallback_rules = lambda name: split_rule(name, cfg)
    tp, pp = tp or saved.tp, pp or saved.pp
    validate_layout(cfg, tp, pp, vp_layers)
    if os.path.exists(checkpoint_dir(save_dir, it)):
        raise ValueError(
            f"--save {save_dir}: {checkpoint_dir(save_dir, it)} already exists; pick an empty "
            "directory"
        )
    full_shapes, rules = model_layout(cfg, family)
    saved_optimizer = first.get("optimizer") or {}
    # A torch optimizer state dict (with its param groups), or the distributed optimizer's;
    # anything else (a bare placeholder some tools write) cannot be cut and is dropped.
    with_optimizer = bool(saved_optimizer.get("distributed")) or "param_groups" in (
        saved_optimizer.get("optimizer") or {}
    )

    def rank_state(names: list[str], tp_rank: int, padded: int):
        shapes = {
            n: _local_shape(full_shapes[n], rules[n], tp, padded, n in vocab_sized_names())
            for n in names
        }
        target = RankTarget(
            shapes,
            {n: rules[n] for n in names},
            tp,
            tp_rank,
            cfg.vocab_size,
            frozenset(vocab_sized_names()),
        )
        model, optimizer = read_rank_state(shards, target, with_optimizer)
        if optimizer is None:
            return model, None, None
        local: dict[str, dict] = {}
        for name, entry in optimizer["distrib_optim"][0]["pieces"].items():
            for key, value in entry.items():
                if key != "range":
                    local.setdefault(key, {})[name] = value
        return model, local, optimizer["optimizer"]

    meta = {k: first[k] for k in _CARRIED if k in first}
    done = write_layout(args, save_dir, tp, pp, it, rank_state, meta, vp_layers, progress)
    return {
        "iteration": it,
        "saved": saved,
        "padded_from": args["padded_vocab_size"],
        "padded_to": cfg.padded_vocab_size(tp),
        "tp": tp,
        "pp": pp,
        "note": CONVERTED_NOTE if done else NO_OPTIMIZER_NOTE,
    }

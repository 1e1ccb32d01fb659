"""The distributed optimizer's state through a TP/PP conversion (tools/convert_checkpoint.py).

A --use-distributed-optimizer checkpoint holds, beside each TP x PP model shard, one file per
DP rank: {parameter name: (flat start, end) in the TP-local parameter, and that range of each
state tensor (Adam's exp_avg / exp_avg_sq, SGD's momentum_buffer, the fp32 `main` weight of
half models) plus Adam's scalar `step`}. Every per-element state has its parameter's shape, so
once reassembled per parameter it merges over TP and splits again exactly like the weights
(megatron.checkpoint.resharding does both). The converter writes it back as DP rank 0 of 1,
which a run at any DP size reshards on load. Plain-optimizer state (its layout is the torch
optimizer's, by position) is still dropped.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.experts import ENTRY_PLACES, saved_elements
from megatron.checkpoint.reading import load_shard
from megatron.checkpoint.storage import DISTRIB_OPTIM_NAME, CheckpointError, save_shard


def is_distributed(shard: dict) -> bool:
    return bool((shard.get("optimizer") or {}).get("distributed"))


def read_rank_state(root: str, iteration: int, shard: dict, **where) -> dict:
    """{state key: {name: tensor shaped like the model shard's}} for one TP x PP rank, from
    every saved DP rank's ranges; {"step": {name: scalar}} too."""
    files = [
        load_shard(root, iteration, name=DISTRIB_OPTIM_NAME.format(dp_rank=k), **where)
        for k in range(shard["optimizer"]["dp_size"])
    ]
    out: dict[str, dict[str, torch.Tensor]] = {}
    covered: dict[str, int] = {}
    for entries in (f["pieces"] for f in files):
        for name, entry in entries.items():
            weight = shard["model"][name]
            count, at = saved_elements(entry)  # a range, or (ETP-split experts) indices
            covered[name] = covered.get(name, 0) + count
            for key, value in entry.items():
                if key in ENTRY_PLACES:
                    continue
                if value.ndim == 0:
                    out.setdefault(key, {})[name] = value
                    continue
                flat = out.setdefault(key, {}).setdefault(
                    name, torch.zeros(weight.numel(), dtype=value.dtype)
                )
                flat[at] = value
    for name, n in covered.items():
        if n != shard["model"][name].numel():
            raise CheckpointError(
                f"{root} iteration {iteration} {where}: the distributed optimizer files cover "
                f"{n} of the {shard['model'][name].numel()} elements of {name}"
            )
    return {
        key: {n: t.view(shard["model"][n].shape) if t.ndim else t for n, t in per.items()}
        for key, per in out.items()
    }


def write_rank_state(
    root: str, iteration: int, local: dict[str, dict[str, torch.Tensor]], **where
) -> None:
    """One TP x PP rank's state as the only DP rank (ranges cover each parameter whole)."""
    pieces: dict[str, dict] = {}
    for key, per in local.items():
        for name, tensor in per.items():
            entry = pieces.setdefault(name, {})
            entry["range"] = (0, tensor.numel()) if tensor.ndim else entry.get("range")
            entry[key] = tensor.reshape(-1).clone() if tensor.ndim else tensor
    for name, entry in pieces.items():
        if entry.get("range") is None:
            raise CheckpointError(f"{name}: only scalar optimizer state, nothing to place")
    state = {"dp_rank": 0, "dp_size": 1, "pieces": pieces}
    save_shard(
        root, iteration, state, write=True, name=DISTRIB_OPTIM_NAME.format(dp_rank=0), **where
    )


def shared_entry(saved: dict) -> dict:
    """The model shard's `optimizer` entry for the converted checkpoint (one DP rank)."""
    keep = {k: saved[k] for k in ("param_groups", "grad_scaler") if k in saved}
    return {"distributed": True, "dp_size": 1, **keep}

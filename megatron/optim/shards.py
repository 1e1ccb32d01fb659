"""The distributed optimizer's checkpoint form, and the plain one's, each read as the other.

A sharded optimizer (--use-distributed-optimizer, --use-torch-fsdp2) saves, per DP rank,
{parameter name: (flat start, end) in the parameter, and the state tensors of that range}, so
a run at another DP size (or another bucket size) reassembles each of its ranges from
whichever saved ranges overlap it (`assemble`). The ranges of an MoE expert tensor count in
the whole tensor of all E experts (megatron.checkpoint.experts), so any EP size finds its
experts' ones; a range of an expert tensor split over expert-TP is not contiguous there: each
TP rank saves the range of every ETP rank (gathered) with the whole tensor's flat index of
each element ("index"), which loads match element by element. The plain optimizer's state
(torch's, keyed by position in `plain_order`) converts to and from this form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.checkpoint.experts import expert_offset, whole_index
from megatron.mpu.expert_shards import is_etp_split
from megatron.mpu.utils import group_size
from megatron.optim.build import param_groups


@dataclass
class Piece:
    """The part [lo, hi) of a flattened parameter that lies in this rank's shard; the same
    elements sit at [buf_lo, buf_hi) of the DDP grad and param buffers."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    buf_lo: int
    buf_hi: int


def parameter_names(module) -> dict[int, str]:
    """id(param) -> its layout-independent name (the chunk's state-dict name)."""
    names = {}
    for chunk in getattr(module, "chunks", [module]):
        for name, p in chunk.named_parameters():
            names[id(p)] = name
    return names


def index_ranges(shards: list[dict]) -> dict[str, list[dict]]:
    """name -> the saved entries of that parameter, from every saved DP rank."""
    index: dict[str, list[dict]] = {}
    for shard in shards:
        for name, entry in shard["pieces"].items():
            index.setdefault(name, []).append(entry)
    return index


def over_etp(entry: dict, group) -> dict:
    """One saved entry of an ETP-split expert range holding the same range of every ETP rank
    (all-gathered, sorted by whole index): each TP rank's file then covers whole experts, as
    the weights and the plain optimizer's state do, so any TP / ETP reads it from one file."""
    size = group_size(group)
    out = {}
    for key, value in sorted(entry.items()):
        if value.ndim == 0:
            out[key] = value
            continue
        parts = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(parts, value.contiguous(), group=group)
        out[key] = torch.cat(parts)
    order = torch.argsort(out["index"])
    return {k: v[order] if v.ndim else v for k, v in out.items()}


def in_whole(pc: Piece, state) -> tuple[Piece, torch.Tensor | None]:
    """`pc` in the coordinates of the saved tensor (experts: the whole one), and, for an
    expert tensor split over ETP, the whole tensor's flat index of each of its elements."""
    if state is not None and is_etp_split(pc.param):
        return pc, whole_index(pc.param, state, pc.lo, pc.hi)
    off = expert_offset(pc.param, state) if state is not None else 0
    return dataclasses.replace(pc, lo=pc.lo + off, hi=pc.hi + off), None


def assemble(pc: Piece, entries: list[dict], need: torch.Tensor | None = None):
    """The state of elements [pc.lo, pc.hi) of one parameter, cut from the saved ranges, or
    of the elements at flat indices `need` (increasing) when given.

    Per-element tensors (moments, main) are copied range by range; scalars (Adam's step) are
    taken from any overlapping range. A gap (the saved ranges do not cover ours) is an error.
    Saved entries with an "index" (experts saved split over ETP) are matched element-wise.
    """
    if need is not None or any("index" in e for e in entries):
        if need is None:
            need = torch.arange(pc.lo, pc.hi)
        return _assemble_elements(pc.name, need, entries)
    out: dict[str, torch.Tensor] = {}
    covered = 0
    for entry in entries:
        s_lo, s_hi = entry["range"]
        lo, hi = max(pc.lo, s_lo), min(pc.hi, s_hi)
        if lo >= hi:
            continue
        covered += hi - lo
        for key, value in entry.items():
            if key == "range":
                continue
            if value.ndim == 0:
                out.setdefault(key, value.clone())
                continue
            if key not in out:
                out[key] = torch.empty(pc.hi - pc.lo, dtype=value.dtype)
            out[key][lo - pc.lo : hi - pc.lo] = value[lo - s_lo : hi - s_lo]
    _check_covered(pc.name, covered, pc.hi - pc.lo, entries, f"[{pc.lo}, {pc.hi})")
    return out


def _check_covered(name: str, covered: int, wanted: int, entries: list, what: str) -> None:
    if entries and covered != wanted:
        raise ValueError(
            f"the saved distributed optimizer state covers {covered} of the {wanted} "
            f"elements {what} of {name}; the checkpoint is incomplete"
        )


def saved_positions(entry: dict, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(where each of the flat indices `need` sits in a saved entry's tensors, which of them
    it holds): by its "index" (increasing) when it has one, else by its "range"."""
    if "index" in entry:
        index = entry["index"]
        pos = torch.searchsorted(index, need).clamp(max=max(index.numel() - 1, 0))
        return pos, index.numel() > 0 and index[pos] == need
    s_lo, s_hi = entry["range"]
    return need - s_lo, (need >= s_lo) & (need < s_hi)


def _assemble_elements(name: str, need: torch.Tensor, entries: list[dict]) -> dict:
    out: dict[str, torch.Tensor] = {}
    covered = 0
    for entry in entries:
        s_lo, s_hi = entry["range"]
        if need.numel() == 0 or s_hi <= need[0] or s_lo > need[-1]:
            continue
        pos, hit = saved_positions(entry, need)
        if isinstance(hit, bool) or not bool(hit.any()):
            continue
        covered += int(hit.sum())
        for key, value in entry.items():
            if key in ("range", "index"):
                continue
            if value.ndim == 0:
                out.setdefault(key, value.clone())
                continue
            if key not in out:
                out[key] = torch.empty(need.numel(), dtype=value.dtype)
            out[key][hit] = value[pos[hit]]
    _check_covered(name, covered, need.numel(), entries, "(by index)")
    return out


def plain_order(module) -> list:
    """The parameters in the plain optimizer's order (its torch state is keyed by position)."""
    return [p for g in param_groups(module) for p in g["params"]]


def plain_parameter_names(module) -> list[str]:
    """The names of the plain optimizer's parameters, by position (what its checkpoint records
    so that its state can be resharded by name)."""
    names = parameter_names(module)
    return [names[id(p)] for p in plain_order(module)]


def plain_to_distributed(saved: dict, module) -> tuple[dict, list[dict]]:
    """A plain optimizer's state dict as (shared part, [one shard]) of this optimizer:
    each parameter's state as one range covering it whole."""
    names, torch_sd = parameter_names(module), saved["optimizer"]
    mains = saved.get("fp32_from_fp16_params")
    pieces = {}
    for i, p in enumerate(plain_order(module)):
        saved = [v for v in torch_sd["state"].get(i, {}).values() if v.ndim]
        entry = {"range": (0, saved[0].numel() if saved else p.numel())}  # experts: all E
        for key, value in torch_sd["state"].get(i, {}).items():
            entry[key] = value.reshape(-1) if value.ndim else value
        if mains is not None:
            entry["main"] = mains[i].reshape(-1)
        pieces[names[id(p)]] = entry
    shared = {"distributed": True, "dp_size": 1, "param_groups": torch_sd["param_groups"]}
    if "grad_scaler" in saved:
        shared["grad_scaler"] = saved["grad_scaler"]
    return shared, [{"pieces": pieces}]


def distributed_to_plain(sd: dict, shards: list[dict], module, half: bool, state=None) -> dict:
    """The distributed optimizer's checkpoint (any DP size) as a plain optimizer's state dict
    for `module`: each parameter's ranges reassembled, keyed by position as torch keys it.
    `state`: this rank's place (with EP > 1, its experts' ranges are taken)."""
    names, index = parameter_names(module), index_ranges(shards)
    saved_groups = {g.get("wd_mult"): g for g in sd["param_groups"]}
    per_param, mains, groups, i = {}, [], [], 0
    for group in param_groups(module):
        hyper = {k: v for k, v in saved_groups.get(group["wd_mult"], {}).items()}
        groups.append({**hyper, "wd_mult": group["wd_mult"], "params": []})
        for p in group["params"]:
            piece = Piece(names[id(p)], p, 0, p.numel(), 0, 0)
            whole, need = in_whole(piece, state)
            restored = assemble(whole, index.get(piece.name, []), need)
            main = restored.pop("main", None)
            if half:
                mains.append(p.detach().float().clone() if main is None else main.view(p.shape))
            if restored:
                per_param[i] = {k: v.view(p.shape) if v.ndim else v for k, v in restored.items()}
            groups[-1]["params"].append(i)
            i += 1
    out = {"optimizer": {"state": per_param, "param_groups": groups}}
    if "grad_scaler" in sd:
        out["grad_scaler"] = sd["grad_scaler"]
    if half:
        out["fp32_from_fp16_params"] = mains
    return out

"""--use-distributed-optimizer: fp32 main weights and optimizer moments sharded over DP.

With the plain optimizer every DP rank holds, per parameter, the fp32 main weight (4 bytes,
half models only) and Adam's two moments (8 bytes): 16 bytes/param for fp32 models (param 4 +
grad 4 + moments 8), 18 for bf16/fp16 (param 2 + grad 4 + main 4 + moments 8). Here each DP
rank keeps them only for its shard of every gradient bucket (megatron.data_parallel.ddp: a bucket
padded to a multiple of DP and cut into DP contiguous shards), so per parameter it holds
4 + 4 + 8 / DP (fp32) or 2 + 4 + 12 / DP (half) bytes.

One step, on every DP rank r:
    grad   buckets reduce-scattered during backward (DDP): shard r holds the DP-averaged grad
    check  inf/NaN over shard r, MAX-all-reduced over all ranks (every rank skips together)
    norm   ||g||^2 = sum over ranks of the shard sums (TP-replicated params on TP rank 0 only,
           the tied embedding's last-stage copy never), summed over DP, then over TP x PP
    update AdamW/SGD on shard r's fp32 mains; copied into the param buffer (half models)
    gather param buckets all-gathered in place (--overlap-param-gather: the next forward waits
           per module, so the all-gather overlaps with the forward)

Checkpoints (megatron.training.state): the shard of each DP rank is saved by that rank as
{parameter name: (flat start, end) in the parameter, and the state tensors of that range}, so a
run at another DP size (or another bucket size) reassembles each of its ranges from whichever
saved ranges overlap it (`load_shards`). The ranges of an MoE expert tensor count in the whole
tensor of all E experts (megatron.checkpoint.experts), so any EP size finds its experts' ones;
a range of an expert tensor split over expert-TP is not contiguous there: each TP rank saves the
range of every ETP rank (gathered) with the whole tensor's flat index of each element ("index"),
which loads match element by element.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.checkpoint.experts import expert_offset, whole_index
from megatron.config.schema import OptimizerConfig
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.mpu import ParallelState
from megatron.mpu.expert_shards import is_etp_split
from megatron.mpu.grads import counts_once, per_tensor_norms
from megatron.mpu.utils import group_size
from megatron.training.muon_sharded import sharded_muon
from megatron.training.optimizer import (
    MegatronOptimizer,
    _torch_optimizer,
    check_state_kind,
    make_grad_scaler,
    param_groups,
    read_skip_and_norm,
)

# Param-group entries that say how this run's torch optimizer computes, not what it computes:
# kept as built here, so a checkpoint of a CUDA (fused) run loads into a CPU run and back.
_IMPLEMENTATION_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")


@dataclass
class _Piece:
    """The part [lo, hi) of a flattened parameter that lies in this rank's shard; the same
    elements sit at [buf_lo, buf_hi) of the DDP grad and param buffers."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    buf_lo: int
    buf_hi: int


def optimizer_over_pieces(mains, pieces, model, cfg, state, muon):
    """The torch optimizer over this rank's flat master ranges `mains` (one per piece): the
    weight-decay and no-decay groups (both always, so every rank's state has the same shape);
    with --optimizer muon `muon(groups, cfg, model, pairs, tp_group)`, where each DP rank
    orthogonalises a share of the matrices."""
    wd_mult = {id(p): g["wd_mult"] for g in param_groups(model.module) for p in g["params"]}
    groups = []
    for mult in (1.0, 0.0):
        pairs = zip(mains, pieces, strict=True)
        mine = [m for m, pc in pairs if wd_mult[id(pc.param)] == mult]
        groups.append({"params": mine, "wd_mult": mult})
    if cfg.optimizer == "muon":
        return muon(groups, cfg, model, list(zip(mains, pieces, strict=True)), state.tp_group)
    return _torch_optimizer(groups, cfg)


def parameter_names(module) -> dict[int, str]:
    """id(param) -> its layout-independent name (the chunk's state-dict name)."""
    names = {}
    for chunk in getattr(module, "chunks", [module]):
        for name, p in chunk.named_parameters():
            names[id(p)] = name
    return names


def shard_pieces(ddp: DistributedDataParallel) -> list[_Piece]:
    """The pieces of parameters in this DP rank's shard of every bucket, in buffer order."""
    names = parameter_names(ddp.module)
    bucket_shards = [b.shard(b.rank, b.size) for b in ddp.buckets]
    pieces = []
    for p, start, end in ddp.param_ranges:
        for s_lo, s_hi in bucket_shards:
            lo, hi = max(start, s_lo), min(end, s_hi)
            if lo < hi:
                pieces.append(_Piece(names[id(p)], p, lo - start, hi - start, lo, hi))
    return pieces


class DistributedOptimizer(MegatronOptimizer):
    """step() -> (updated?, grad norm or None), as MegatronOptimizer, on this DP rank's shard."""

    def __init__(
        self,
        model: DistributedDataParallel,
        cfg: OptimizerConfig,
        *,
        params_dtype: torch.dtype,
        state: ParallelState,
        clip_grad: float,
        overlap_param_gather: bool = False,
    ):
        if not getattr(model, "distributed", False):
            raise ValueError(
                "DistributedOptimizer needs DistributedDataParallel built with "
                "use_distributed_optimizer=True (sharded, padded buckets)"
            )
        self.state, self.clip_grad, self.ddp = state, clip_grad, model
        self.device = model.grad_buffer.device
        self.overlap_param_gather = overlap_param_gather
        self.half = params_dtype in (torch.float16, torch.bfloat16)
        self.kind = cfg.optimizer
        self.pieces = shard_pieces(model)
        self.mains = [self._main(piece) for piece in self.pieces]
        self.optimizer = optimizer_over_pieces(
            self.mains, self.pieces, model, cfg, state, sharded_muon
        )
        self.scaler = make_grad_scaler(cfg, params_dtype)

    def _main(self, piece: _Piece) -> torch.Tensor:
        """fp32 models: a view of the param buffer (updated in place); half: an fp32 copy."""
        view = self._weights(piece)
        return view.detach().clone().float() if self.half else view

    def _weights(self, piece: _Piece) -> torch.Tensor:
        """The model's weights of `piece` (flat): its elements of the param buffer."""
        return self.ddp.param_buffer[piece.buf_lo : piece.buf_hi]

    def _pairs(self):
        yield from zip(self.pieces, self.mains, strict=True)

    def _grads(self) -> list[torch.Tensor]:
        return [self.ddp.grad_buffer[pc.buf_lo : pc.buf_hi] for pc in self.pieces]

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the whole model's gradient: every element counted once over all ranks."""
        tp_rank = self.state.tp_rank
        counted = [
            g for g, pc in zip(grads, self.pieces, strict=True) if counts_once(pc.param, tp_rank)
        ]
        squares = [n.float() ** 2 for n in per_tensor_norms(counted, 2.0)]  # fused per dtype
        total = torch.stack(squares).sum() if squares else torch.zeros(())
        total = total.to(self.device)
        for group in (self.ddp.dp_group, self.state.mp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def _step(self, loss: torch.Tensor | None) -> tuple[bool, float | None]:
        grads = self._grads()
        for main, grad in zip(self.mains, grads, strict=True):
            main.grad = grad  # the DP-averaged shard of the gradient, no copy
        flag = self._unscale_and_check(grads, loss)
        norm = self._grad_norm(grads)  # equal on every rank: the skip is agreed
        if self.clip_grad > 0 and grads:  # on the device; a skipped step's grads are dropped
            coef = (self.clip_grad / (norm.double() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, torch.where(torch.isfinite(norm), coef, 1.0))
        if self.skip_on_device:
            return self._update_unless(flag, norm)
        found_inf, norm = read_skip_and_norm(flag, norm)  # the step's one host read
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            return False, norm
        self.optimizer.step()
        self._after_update()
        return True, norm

    def _after_update(self) -> None:
        """The updated shard into the param buffer (half models), then all-gathered over DP."""
        if self.half and self.pieces:  # one fused copy of every piece
            views = [self._weights(pc) for pc in self.pieces]
            torch._foreach_copy_(views, self.mains)
        self.ddp.start_param_sync(overlap=self.overlap_param_gather)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 mains from the (loaded) weights in the param buffer."""
        self.ddp.finish_param_sync()
        if self.half:
            for pc, main in self._pairs():
                main.copy_(self._weights(pc))

    def state_dict(self) -> dict:
        """What every DP rank shares (DP rank 0 writes it in the model shard); the sharded
        part is `shard_state_dict`."""
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        sd = {"distributed": True, "dp_size": self.ddp.dp_size, "param_groups": groups}
        if self.scaler is not None:
            sd["grad_scaler"] = self.scaler.state_dict()
        return sd

    def shard_state_dict(self) -> dict:
        """This DP rank's ranges: name -> {"range": (lo, hi), state name -> tensor}; "main" is
        the fp32 main weight of half models (fp32 models keep theirs in the model shard)."""
        pieces = {}
        for pc, main in self._pairs():
            entry = dict(self.optimizer.state.get(main, {}))
            if self.half:
                entry["main"] = main.detach()
            if is_etp_split(pc.param):  # experts split over ETP: each element's whole index
                index = whole_index(pc.param, self.state, pc.lo, pc.hi)
                entry = _over_etp({"index": index, **entry}, self.state.etp_group)
                entry["range"] = (int(entry["index"][0]), int(entry["index"][-1]) + 1)
            else:
                off = expert_offset(pc.param, self.state)  # experts: ranges in the whole tensor
                entry["range"] = (pc.lo + off, pc.hi + off)
            pieces[pc.name] = entry
        return {"dp_rank": self.ddp.dp_rank, "dp_size": self.ddp.dp_size, "pieces": pieces}

    @torch.no_grad()
    def load_state_dict(self, sd: dict, shards: list[dict] | None = None) -> None:
        """Restore from the shared part `sd` and the saved DP ranks' `shards` (any DP size)."""
        if not sd.get("distributed"):  # the plain optimizer's: every parameter whole
            sd, shards = plain_to_distributed(sd, self.ddp.module)
        saved_groups = {g.get("wd_mult"): g for g in sd["param_groups"]}
        for group in self.optimizer.param_groups:
            saved = saved_groups.get(group["wd_mult"], {})
            group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS})
        if self.scaler is not None and "grad_scaler" in sd:
            self.scaler.load_state_dict(sd["grad_scaler"])
        saved_ranges = _index_ranges(shards)
        for pc, main in self._pairs():
            whole, need = _in_whole(pc, self.state)
            restored = _assemble(whole, saved_ranges.get(pc.name, []), need)
            if "main" in restored:
                main.copy_(restored.pop("main"))
            elif self.half:  # saved before this param had a main: take the weights
                main.copy_(self._weights(pc))
            if restored:
                device = main.device
                self.optimizer.state[main] = {k: v.to(device) for k, v in restored.items()}
        if self.kind is not None:
            check_state_kind(self.optimizer, self.kind)


def _index_ranges(shards: list[dict]) -> dict[str, list[dict]]:
    """name -> the saved entries of that parameter, from every saved DP rank."""
    index: dict[str, list[dict]] = {}
    for shard in shards:
        for name, entry in shard["pieces"].items():
            index.setdefault(name, []).append(entry)
    return index


def _over_etp(entry: dict, group) -> dict:
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


def _in_whole(pc: _Piece, state) -> tuple[_Piece, torch.Tensor | None]:
    """`pc` in the coordinates of the saved tensor (experts: the whole one), and, for an
    expert tensor split over ETP, the whole tensor's flat index of each of its elements."""
    if state is not None and is_etp_split(pc.param):
        return pc, whole_index(pc.param, state, pc.lo, pc.hi)
    off = expert_offset(pc.param, state) if state is not None else 0
    return dataclasses.replace(pc, lo=pc.lo + off, hi=pc.hi + off), None


def _assemble(pc: _Piece, entries: list[dict], need: torch.Tensor | None = None):
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


def _plain_order(module) -> list:
    """The parameters in MegatronOptimizer's order (its torch state is keyed by position)."""
    return [p for g in param_groups(module) for p in g["params"]]


def plain_parameter_names(module) -> list[str]:
    """The names of the plain optimizer's parameters, by position (what its checkpoint records
    so that its state can be resharded by name)."""
    names = parameter_names(module)
    return [names[id(p)] for p in _plain_order(module)]


def plain_to_distributed(saved: dict, module) -> tuple[dict, list[dict]]:
    """A plain MegatronOptimizer state dict as (shared part, [one shard]) of this optimizer:
    each parameter's state as one range covering it whole."""
    names, torch_sd = parameter_names(module), saved["optimizer"]
    mains = saved.get("fp32_from_fp16_params")
    pieces = {}
    for i, p in enumerate(_plain_order(module)):
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
    """The distributed optimizer's checkpoint (any DP size) as a MegatronOptimizer state dict
    for `module`: each parameter's ranges reassembled, keyed by position as torch keys it.
    `state`: this rank's place (with EP > 1, its experts' ranges are taken)."""
    names, index = parameter_names(module), _index_ranges(shards)
    saved_groups = {g.get("wd_mult"): g for g in sd["param_groups"]}
    per_param, mains, groups, i = {}, [], [], 0
    for group in param_groups(module):
        hyper = {k: v for k, v in saved_groups.get(group["wd_mult"], {}).items()}
        groups.append({**hyper, "wd_mult": group["wd_mult"], "params": []})
        for p in group["params"]:
            piece = _Piece(names[id(p)], p, 0, p.numel(), 0, 0)
            whole, need = _in_whole(piece, state)
            restored = _assemble(whole, index.get(piece.name, []), need)
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

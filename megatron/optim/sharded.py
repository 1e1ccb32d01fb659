"""The fp32 pieces of the sharded optimizers (--use-distributed-optimizer, --use-torch-fsdp2):
flat ranges of parameters on this DP rank, wherever the backend keeps them.

One step, on every DP rank r (megatron.optim.optimizer's tail around these):
    grad   shard r holds the DP-averaged gradient (reduce-scattered in backward)
    check  inf/NaN over shard r, MAX-all-reduced over all ranks (every rank skips together)
    norm   ||g||^2 = sum over ranks of the shard sums (TP-replicated params on TP rank 0 only,
           the tied embedding's last-stage copy never), summed over DP, then over TP x PP;
           clipping scales the shards
    update the torch optimizer on shard r's fp32 mains; the place takes them from there

Checkpoints: megatron.optim.shards' form, one file per DP (x CP) rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.checkpoint.experts import expert_offset, whole_index
from megatron.mpu.expert_shards import is_etp_split
from megatron.mpu.grads import counts_once, per_tensor_norms
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.utils import group_size
from megatron.optim.build import param_groups
from megatron.optim.matrices import Feed
from megatron.optim.shards import (
    assemble,
    in_whole,
    index_ranges,
    over_etp,
    plain_to_distributed,
)

# Param-group entries that say how this run's torch optimizer computes, not what it computes:
# kept as built here, so a checkpoint of a CUDA (fused) run loads into a CPU run and back.
_IMPLEMENTATION_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")


class ShardPieces:
    """Flat ranges of parameters as the fp32 mains (megatron.optim.optimizer's pieces), where
    `place` keeps them: this DP rank's shard of our DDP's buckets (megatron.optim.distributed's
    Buckets) or of FSDP2's row shards (megatron.optim.fsdp2's RowShards). A place has `model`
    (module, dp_group, dp_rank, dp_size), `pieces`, `mains`, `device`, `weights(piece)`,
    `grads()`, `after_update(masters)`, `reload(masters)` and `exchange(pairs, selected, fn)`
    (megatron.optim.matrices)."""

    sharded, offload = True, False

    def __init__(self, place, state: ParallelState, masters: bool):
        self.place, self.model, self.state, self.masters = place, place.model, state, masters
        self.pieces, self.mains, self.device = place.pieces, place.mains, place.device

    def groups(self) -> list[dict]:
        """The weight-decay and no-decay groups (both always, so every rank's state has the
        same shape)."""
        wd_mult = {
            id(p): g["wd_mult"] for g in param_groups(self.model.module) for p in g["params"]
        }
        groups = []
        for mult in (1.0, 0.0):
            pairs = zip(self.mains, self.pieces, strict=True)
            mine = [m for m, pc in pairs if wd_mult[id(pc.param)] == mult]
            groups.append({"params": mine, "wd_mult": mult})
        return groups

    def feed(self) -> Feed:
        pairs = list(zip(self.mains, self.pieces, strict=True))
        return Feed(
            self.model.module,
            self.state.tp_group,
            [(main, pc.param) for main, pc in pairs],
            lambda selected, fn: self.place.exchange(pairs, selected, fn),
        )

    def _pairs(self):
        yield from zip(self.pieces, self.mains, strict=True)

    def grads(self) -> list[torch.Tensor]:
        grads = self.place.grads()
        for main, grad in zip(self.mains, grads, strict=True):
            main.grad = grad  # the DP-averaged shard of the gradient, no copy
        return grads

    def norm_and_clip(self, grads: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """L2 norm of the whole model's gradient: every element counted once over all ranks;
        clipping scales the shards on the device (a skipped step's grads are dropped)."""
        tp_rank = self.state.tp_rank
        counted = [
            g for g, pc in zip(grads, self.pieces, strict=True) if counts_once(pc.param, tp_rank)
        ]
        squares = [n.float() ** 2 for n in per_tensor_norms(counted, 2.0)]  # fused per dtype
        total = torch.stack(squares).sum() if squares else torch.zeros(())
        total = total.to(self.device)
        for group in (self.model.dp_group, self.state.mp_group):
            if group_size(group) > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        if clip_grad > 0 and grads:
            coef = (clip_grad / (norm.double() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, torch.where(torch.isfinite(norm), coef, 1.0))
        return norm

    def before_update(self) -> None:
        """The mains are where the step runs."""

    def after_update(self) -> None:
        self.place.after_update(self.masters)

    def release(self) -> None:
        """The mains' .grad are views of the gradients, set again every step."""

    def reload_model_params(self) -> None:
        """Refresh the fp32 mains from the (loaded) weights."""
        self.place.reload(self.masters)

    def state_dict(self, optimizer, scaler) -> dict:
        """What every DP rank shares (DP rank 0 writes it in the model shard); the sharded
        part is `shard_state_dict`."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        sd = {"distributed": True, "dp_size": self.model.dp_size, "param_groups": groups}
        if scaler is not None:
            sd["grad_scaler"] = scaler.state_dict()
        return sd

    def shard_state_dict(self, optimizer) -> dict:
        """This DP rank's ranges: name -> {"range": (lo, hi), state name -> tensor}; "main" is
        the fp32 main weight of half models (fp32 models keep theirs in the model shard)."""
        pieces = {}
        for pc, main in self._pairs():
            entry = dict(optimizer.state.get(main, {}))
            if self.masters:
                entry["main"] = main.detach()
            if is_etp_split(pc.param):  # experts split over ETP: each element's whole index
                index = whole_index(pc.param, self.state, pc.lo, pc.hi)
                entry = over_etp({"index": index, **entry}, self.state.etp_group)
                entry["range"] = (int(entry["index"][0]), int(entry["index"][-1]) + 1)
            else:
                off = expert_offset(pc.param, self.state)  # experts: ranges in the whole tensor
                entry["range"] = (pc.lo + off, pc.hi + off)
            pieces[pc.name] = entry
        return {"dp_rank": self.model.dp_rank, "dp_size": self.model.dp_size, "pieces": pieces}

    def load_state_dict(self, optimizer, sd: dict, shards, check) -> None:
        """Restore from the shared part `sd` and the saved DP ranks' `shards` (any DP size)."""
        if not sd.get("distributed"):  # the plain optimizer's: every parameter whole
            sd, shards = plain_to_distributed(sd, self.model.module)
        saved_groups = {g.get("wd_mult"): g for g in sd["param_groups"]}
        for group in optimizer.param_groups:
            saved = saved_groups.get(group["wd_mult"], {})
            group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS})
        saved_ranges = index_ranges(shards)
        for pc, main in self._pairs():
            whole, need = in_whole(pc, self.state)
            restored = assemble(whole, saved_ranges.get(pc.name, []), need)
            if "main" in restored:
                main.copy_(restored.pop("main"))
            elif self.masters:  # saved before this param had a main: take the weights
                main.copy_(self.place.weights(pc))
            if restored:
                device = main.device
                optimizer.state[main] = {k: v.to(device) for k, v in restored.items()}
        check()

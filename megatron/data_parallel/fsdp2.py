"""--use-torch-fsdp2: weights, gradients and optimizer state sharded over DP (x CP) by FSDP2.

torch.distributed.fsdp.fully_shard runs over a DeviceMesh of the DP x CP group (the ranks that
hold replicas of the same TP-local weights; CP splits the sequence, not the weights). Each
transformer layer is a unit (its weights all-gathered before it runs, freed after forward with
--torch-fsdp2-reshard-after-forward true or auto, and its gradients reduce-scattered as its
backward ends); so is the untied embedding and the head; the chunk itself is the root unit
holding the rest (a tied word embedding, or with MTP: the head or the MTP depths read it outside the
embedding's forward;
auto keeps the root's weights gathered from forward to backward, which needs them first). TP is
untouched: the TP-local tensors are what FSDP2 shards, and TP's collectives run inside the
layers as before.

Shards: each parameter is a DTensor placed Shard(0) on the mesh, so DP x CP rank r holds rows
[r c, min((r + 1) c, d0)) of the TP-local tensor (c = ceil(d0 / N), torch.chunk's split; the
last ranks may hold fewer rows or none): `local_rows` gives them. In the flattened tensor those
rows are one contiguous range, the form the distributed optimizer's checkpoint records, so
FSDP2's optimizer state saves and loads through the same code (any DP size, plain or sharded).

Precision: the sharded parameters are fp32 whatever --bf16 / --fp16 says: they are the master
weights. MixedPrecisionPolicy casts them to the run's dtype as they are all-gathered (compute
in bf16 / fp16), and gradients are reduce-scattered in fp32 (--allreduce-dtype params: in the
run's dtype) and kept in fp32.

Gradient accumulation: without pipelining the micro batches before the last one accumulate
unsharded gradients (no reduce-scatter, `no_sync`); with pipelining every micro batch's
backward reduce-scatters (its backwards interleave with other micro batches' forwards).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from megatron.mpu.utils import PARALLEL_ATTRS, group_rank, group_size

# --torch-fsdp2-reshard-after-forward -> fully_shard's reshard_after_forward (None: FSDP2's
# auto, True for every unit but the root, which backward needs first)
RESHARD_AFTER_FORWARD = {"auto": None, "true": True, "false": False}
# the mpu attributes fully_shard's new parameters must keep (norm counting, SP sums, ties)
_KEPT_ATTRS = (*PARALLEL_ATTRS, "sequence_parallel")


def local_rows(param: DTensor) -> tuple[int, int]:
    """[first, last) rows of the TP-local tensor that this rank's shard of `param` holds."""
    (placement,) = param.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"expected an FSDP2 parameter sharded on dim 0, got {param.placements}")
    mesh = param.device_mesh
    rows, n, r = param.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(rows / n)
    first, last = min(r * chunk, rows), min((r + 1) * chunk, rows)
    if param.to_local().shape[0] != last - first:
        raise ValueError(
            f"FSDP2 shard of {tuple(param.shape)} on rank {r} of {n}: "
            f"{tuple(param.to_local().shape)}, expected rows [{first}, {last})"
        )
    return first, last


def local_tensor(param: DTensor) -> torch.Tensor:
    """This rank's shard of `param` (its storage: updating it updates the parameter)."""
    with torch.no_grad():
        return param.to_local()


def _units(chunk: nn.Module) -> list[nn.Module]:
    """The layers of `chunk` that are sharding units of their own: each transformer layer, the
    embedding unless the last stage reads its weight outside its forward (a tied head, or
    the MTP depths' input embedding), the head unless MTP calls it outside its forward."""
    layers = chunk.layer_list() if hasattr(chunk, "layer_list") else []
    tied = getattr(chunk, "shares_embedding", getattr(chunk, "tied", False))
    # the MTP depths call the head's loss outside its forward: the head stays in the root too
    mtp = getattr(chunk, "mtp", None) is not None
    outside = [getattr(chunk, "embedding", None) if tied else None]
    outside.append(getattr(chunk, "head", None) if mtp else None)
    units, seen = [], set()
    for layer in layers:
        if id(layer) in seen or any(layer is m for m in outside if m is not None):
            continue
        seen.add(id(layer))
        units.append(layer)
    return units


def _named_attrs(module: nn.Module) -> dict[str, dict]:
    return {
        name: {a: getattr(p, a) for a in _KEPT_ATTRS if hasattr(p, a)}
        for name, p in module.named_parameters()
    }


def _shard_chunk(chunk: nn.Module, **kw) -> None:
    """fully_shard each unit of `chunk`, then the chunk (the root: what is left), in fp32."""
    attrs = _named_attrs(chunk)
    for p in chunk.parameters():
        p.data = p.data.float()  # the shards are the fp32 master weights
    for unit in _units(chunk):
        fully_shard(unit, **kw)
    fully_shard(chunk, **kw)
    for name, p in chunk.named_parameters():  # fully_shard made new parameters: the mpu
        for a, v in attrs[name].items():  # attributes back (norm counting, SP sums, ties)
            setattr(p, a, v)


class FullyShardedModel(nn.Module):
    """ModelChunks under FSDP2, with our DDP's interface (module, no_sync, finish_grad_sync,
    zero_grad_buffer, state dicts of whole TP-local tensors), so the schedules, the step and
    the checkpoint code do not know which one runs."""

    def __init__(
        self,
        module: nn.Module,
        group,
        *,
        params_dtype: torch.dtype,
        reduce_dtype: torch.dtype = torch.float32,
        reshard_after_forward: bool | None = None,
        accumulate_unsharded: bool = True,
    ):
        super().__init__()
        if group is None or not dist.is_initialized():
            raise ValueError("--use-torch-fsdp2 needs torch.distributed and a DP x CP group")
        self.module = module
        self.dp_group, self.dp_size, self.dp_rank = group, group_size(group), group_rank(group)
        self.params_dtype = params_dtype
        self.accumulate_unsharded = accumulate_unsharded
        device = next(module.parameters()).device
        meta = device.type == "meta"  # laid out only (bench/memory.py): the collectives' device
        kind = "cpu" if meta else device.type
        self.mesh = DeviceMesh.from_group(group, kind, mesh_dim_names=("dp_cp",))
        half = params_dtype in (torch.float16, torch.bfloat16)
        policy = MixedPrecisionPolicy(
            param_dtype=params_dtype if half else None,
            reduce_dtype=reduce_dtype if half else None,
        )
        kw = {
            "mesh": self.mesh,
            "mp_policy": policy,
            "reshard_after_forward": reshard_after_forward,
        }
        chunks = list(getattr(module, "chunks", [module]))
        for chunk in chunks:
            _shard_chunk(chunk, **kw)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in self.units if not meta else ():  # settle each shard's storage now (FSDP2
            unit.unshard()  # re-pads empty shards lazily): the optimizer holds those that stay
            unit.reshard()
        self.params = [p for p in module.parameters() if p.requires_grad]
        # FSDP2 registers the gathered tensors on the modules while a unit is unsharded (after
        # an evaluation forward without --torch-fsdp2-reshard-after-forward true): the sharded
        # parameters and their names are kept here
        self.names = {id(p): n for c in chunks for n, p in c.named_parameters()}

    def reshard(self) -> None:
        """Free every gathered weight: the modules hold their sharded parameters again."""
        for unit in self.units:
            unit.reshard()

    def train(self, mode: bool = True):
        self.reshard()  # an evaluation's gathered weights, freed before training resumes
        return super().train(mode)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _set_sync(self, sync: bool) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro batches before the last: unsharded gradients accumulate, no reduce-scatter
        (with pipelining, `accumulate_unsharded` False: every backward reduce-scatters)."""
        if not self.accumulate_unsharded:
            yield
            return
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def finish_grad_sync(self) -> None:
        """Backward has reduce-scattered (FSDP2 waits for it as backward ends): point each
        parameter's `main_grad` at this rank's fp32 shard of its averaged gradient."""
        self.reshard()
        for p in self.params:
            local = local_tensor(p)
            if p.grad is None:  # unused this step: a zero gradient, as our DDP's buffer
                p.main_grad = torch.zeros_like(local, dtype=torch.float32)
            else:
                p.main_grad = local_tensor(p.grad)

    def zero_grad_buffer(self) -> None:
        for p in self.params:
            p.grad = None
            p.main_grad = None

    def state_dict(self, *args, **kwargs):
        """Whole TP-local tensors in the run's dtype, as our DDP's, for the checkpoint's writer
        (DP x CP rank 0), on the CPU: each parameter is all-gathered over DP x CP in turn and
        moved off the device at once, so one whole parameter is the extra device memory. The
        other ranks get meta tensors of the same shapes (names and shapes are all they read)."""
        self.reshard()
        writer = self.dp_rank == 0
        out = {}
        for name, value in self.module.state_dict().items():
            if isinstance(value, DTensor):
                whole = value.full_tensor()  # a collective: every DP x CP rank takes part
                where = "cpu" if writer else "meta"
                value = whole.to(where, self.params_dtype)
            out[name] = value
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True):
        """Whole TP-local tensors (any dtype) into this rank's shards (their rows), in place."""
        self.reshard()
        own = {}
        for chunk in getattr(self.module, "chunks", [self.module]):
            own.update(chunk.named_parameters())
            own.update(chunk.named_buffers())
        own = {k: v for k, v in own.items() if k in self.module.state_dict()}  # persistent
        missing = [k for k in own if k not in state_dict]
        unused = [k for k in state_dict if k not in own]
        if strict and (missing or unused):
            raise KeyError(
                f"checkpoint keys do not match the model: missing {missing[:5]}, "
                f"unexpected {unused[:5]}"
            )
        for name, value in own.items():
            if name not in state_dict:
                continue
            if isinstance(value, DTensor):
                first, last = local_rows(value)
                local_tensor(value).copy_(state_dict[name][first:last])
            else:
                value.copy_(state_dict[name])

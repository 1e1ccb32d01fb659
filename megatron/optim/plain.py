"""The plain optimizer's pieces: every parameter whole on every DP rank.

For fp32 models the fp32 mains are the parameters themselves; for bf16/fp16 models (and for
any model with `cpu_offload`) they are fp32 master copies, updated and copied back.

`cpu_offload` (--cpu-optimizer) keeps the fp32 masters and the optimizer states on the CPU for
every precision: the inf/NaN check and clipping run on the gradients where they are, then the
clipped gradients are copied to the CPU, the step runs there, and the weights are copied back.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config.schema_optimizer import OptimizerConfig
from megatron.mpu.grads import clip_grad_norm
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.utils import PARALLEL_ATTRS
from megatron.optim.build import param_groups
from megatron.optim.matrices import Feed, Whole
from megatron.optim.optimizer import MegatronOptimizer


def with_parallel_attrs(new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    for attr in PARALLEL_ATTRS:
        if hasattr(p, attr):
            setattr(new, attr, getattr(p, attr))
    return new


def _fp32_copy(p: torch.Tensor, device=None) -> torch.Tensor:
    """fp32 master of a parameter (on `device`), keeping the attributes grad-norm counting
    relies on."""
    return with_parallel_attrs(p.detach().clone().float().to(device or p.device), p)


class PlainPieces:
    """Each parameter's fp32 main, whole (megatron.optim.optimizer's pieces)."""

    sharded = False

    def __init__(self, model: nn.Module, state: ParallelState, params_dtype, cpu_offload=False):
        self.model, self.state = model, state
        self.model_groups = param_groups(model)
        self.offload = cpu_offload
        # Separate fp32 masters: for half weights, and for any weights when they live on the CPU.
        self.masters = params_dtype in (torch.float16, torch.bfloat16) or cpu_offload
        self._holders: list[torch.Tensor] | None = None
        if self.masters:
            where = "cpu" if cpu_offload else None
            self.main_groups = [
                {**g, "params": [_fp32_copy(p, where) for p in g["params"]]}
                for g in self.model_groups
            ]
        else:
            self.main_groups = [dict(g) for g in self.model_groups]

    def groups(self) -> list[dict]:
        return self.main_groups

    def feed(self) -> Feed:
        pairs = [(main, p) for p, main in self._pairs()]
        param_of = {id(main): p for main, p in pairs}
        return Feed(self.model, self.state.tp_group, pairs, lambda _, fn: Whole(param_of, fn))

    def _pairs(self):
        for model_g, main_g in zip(self.model_groups, self.main_groups, strict=True):
            yield from zip(model_g["params"], main_g["params"], strict=True)

    def _carriers(self) -> list[torch.Tensor]:
        """Tensors whose .grad is each fp32 main_grad, on the gradients' device, with the mpu
        attributes: the main params themselves, or (offload: the masters are on the CPU)
        stand-ins aliasing main_grad, so the norm and its all-reduce run where the grads are."""
        if not self.offload:
            carriers = [main_p for _, main_p in self._pairs()]
        else:
            if self._holders is None:
                self._holders = [
                    with_parallel_attrs(model_p.main_grad.detach(), model_p)
                    for model_p, _ in self._pairs()
                ]
            carriers = self._holders
        for (model_p, _), carrier in zip(self._pairs(), carriers, strict=True):
            carrier.grad = model_p.main_grad  # fp32 view of the DP-reduced gradient, no copy
        return carriers

    def grads(self) -> list[torch.Tensor]:
        self.carriers = self._carriers()
        return [c.grad for c in self.carriers]

    def norm_and_clip(self, grads: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
        """All-reduced over TP x PP; DP ranks hold equal reduced gradients."""
        st = self.state
        return clip_grad_norm(
            self.carriers,
            clip_grad,
            tp_rank=st.tp_rank,
            model_parallel_group=st.mp_group,
            expert_group=st.ep_group,
        )

    def before_update(self) -> None:
        if self.offload:
            for (_, main_p), carrier in zip(self._pairs(), self.carriers, strict=True):
                main_p.grad = carrier.grad.to(main_p.device)  # the clipped gradient, on the CPU

    def after_update(self) -> None:
        """The updated fp32 masters into the model's weights (half models, offload), in one
        fused copy per device (masters on the CPU: per tensor, across devices)."""
        if not self.masters:
            return
        pairs = list(self._pairs())
        if self.offload:
            for model_p, main_p in pairs:
                model_p.copy_(main_p)
        elif pairs:
            torch._foreach_copy_([m for m, _ in pairs], [p for _, p in pairs])

    def release(self) -> None:
        """Drop the aliases of main_grad: for fp32 models main params are the model's, and a
        .grad left set would make autograd accumulate the next gradient into it directly."""
        for carrier in [main_p for _, main_p in self._pairs()] + (self._holders or []):
            carrier.grad = None

    def reload_model_params(self) -> None:
        if self.masters:
            for model_p, main_p in self._pairs():
                main_p.copy_(model_p)

    def state_dict(self, optimizer, scaler) -> dict:
        sd = {"optimizer": optimizer.state_dict()}
        if scaler is not None:
            sd["grad_scaler"] = scaler.state_dict()
        if self.masters:
            sd["fp32_from_fp16_params"] = [p for _, p in self._pairs()]
        return sd

    def load_state_dict(self, optimizer, sd: dict, shards, check) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check([(params[i], st) for i, st in sd["optimizer"]["state"].items()])  # by position
        optimizer.load_state_dict(sd["optimizer"])
        if self.masters and "fp32_from_fp16_params" in sd:
            for (_, main_p), saved in zip(self._pairs(), sd["fp32_from_fp16_params"], strict=True):
                main_p.copy_(saved)


def plain_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    *,
    params_dtype: torch.dtype,
    state: ParallelState,
    clip_grad: float,
    cpu_offload: bool = False,
) -> MegatronOptimizer:
    """The optimizer over whole parameters (no --use-distributed-optimizer, no FSDP2)."""
    pieces = PlainPieces(model, state, params_dtype, cpu_offload)
    return MegatronOptimizer(pieces, cfg, params_dtype=params_dtype, clip_grad=clip_grad)

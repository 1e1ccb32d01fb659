"""AdamW / SGD / Muon (megatron.training.muon) over fp32 main weights, with fp16 loss scaling
and global skip-on-overflow.

Gradients arrive in each parameter's fp32 `main_grad` (see megatron.data_parallel.ddp). For fp32
models the optimizer updates the parameters themselves; for bf16/fp16 models it keeps an fp32
master copy of every parameter, updates that, and copies it back. Before each step, one scalar
all-reduce over all ranks decides whether any gradient is inf/NaN: if so every rank skips the
update together (and fp16 lowers its loss scale). The same happens, in every precision, when the
caller reports a non-finite loss or the gradient norm is not finite (finite gradients whose
squares overflow): Adam would otherwise turn such a step into a full-size update of every weight.

Where the torch optimizer takes the decision as an input (fused AdamW's `found_inf`: its kernel
then leaves weights, moments and step count as they were), the decision stays on the device:
step() returns device tensors (updated?, norm), the host never waits for the gradients, and the
caller reads them when it logs. Elsewhere (SGD, apex, --cpu-optimizer, and a dynamic fp16 loss
scale, whose next value the host needs) the host reads the decision once per step.

`cpu_offload` (--cpu-optimizer) keeps the fp32 masters and the optimizer states on the CPU for
every precision: the inf/NaN check and clipping run on the gradients where they are, then the
clipped gradients are copied to the CPU, the step runs there, and the weights are copied back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatron.config.schema import OptimizerConfig
from megatron.mpu import ParallelState, clip_grad_norm
from megatron.mpu.utils import PARALLEL_ATTRS
from megatron.training.muon import WholeMatrices, build_muon, matrix_layouts, muon_settings


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (all 1-D) get wd_mult 0."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 else decay).append(p)
    return [
        g
        for g in ({"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0})
        if g["params"]
    ]


class DynamicGradScaler:
    """Loss scale: halved after `hysteresis` overflows, doubled after `window` clean steps."""

    def __init__(self, initial: float, minimum: float, window: int, hysteresis: int):
        self.scale, self.min_scale = float(initial), float(minimum)
        self.window, self.hysteresis = window, hysteresis
        self._growth, self._hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._growth += 1
            if self._growth == self.window:
                self._growth, self._hysteresis_left = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth,
            "hysteresis_tracker": self._hysteresis_left,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._growth = int(sd["growth_tracker"])
        self._hysteresis_left = int(sd["hysteresis_tracker"])


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass  # a static scale never changes; overflowing steps are still skipped

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])


def make_grad_scaler(cfg: OptimizerConfig, params_dtype: torch.dtype):
    """fp16: the static (--loss-scale) or dynamic loss scaler; other precisions: None."""
    if params_dtype != torch.float16:
        return None
    if cfg.loss_scale:
        return ConstantGradScaler(cfg.loss_scale)
    return DynamicGradScaler(
        cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis
    )


def _torch_optimizer(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    for g in groups:
        g["weight_decay"] = cfg.weight_decay * g["wd_mult"]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    if cfg.optimizer != "adam":  # muon: built by its optimizer's own path, never AdamW instead
        raise ValueError(f"--optimizer {cfg.optimizer} is not built here (adam and sgd are)")
    kw = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, only if the user installed it

        if all(p.is_cuda for g in groups for p in g["params"]):
            return FusedAdam(groups, adam_w_mode=True, **kw)
    except ImportError:
        pass
    try:  # torch's fused kernel (CUDA, and CPU since torch 2.4): one pass, takes found_inf
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kw)


def check_state_kind(optimizer: torch.optim.Optimizer, kind: str, states=None) -> None:
    """A loaded state must be this optimizer's: Adam's moments where AdamW steps, a momentum
    buffer where SGD or Muon does (a resume with another --optimizer would fail in torch, or
    silently start a moment from zero). `states`: (param, state) pairs, default the
    optimizer's own."""
    muon_ids = getattr(optimizer, "muon_ids", set())
    for p, state in optimizer.state.items() if states is None else states:
        want = "momentum_buffer" if kind == "sgd" or id(p) in muon_ids else "exp_avg"
        if state and want not in state:
            raise ValueError(
                f"the checkpoint's optimizer state holds {sorted(state)}, not the {want} that "
                f"--optimizer {kind} keeps: it was saved by another --optimizer. Fix: resume "
                "with the --optimizer it was saved with, or pass --no-load-optim"
            )


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer skips its update on a device flag (`optimizer.found_inf`, 0-d, 1.0 =
    skip): torch's fused AdamW. Not fused SGD: a first step skipped that way leaves its momentum
    buffer uninitialized (torch 2.13 on the CPU)."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def _with_parallel_attrs(new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    for attr in PARALLEL_ATTRS:
        if hasattr(p, attr):
            setattr(new, attr, getattr(p, attr))
    return new


def _fp32_copy(p: torch.Tensor, device=None) -> torch.Tensor:
    """fp32 master of a parameter (on `device`), keeping the attributes grad-norm counting
    relies on."""
    return _with_parallel_attrs(p.detach().clone().float().to(device or p.device), p)


class MegatronOptimizer:
    """step() -> (updated?, grad norm or None). Skips are global and counted by the caller."""

    # Subclasses (the distributed optimizer) keep their masters on the device: no stand-ins.
    offload = False
    _holders: list[torch.Tensor] | None = None
    kind: str | None = None  # --optimizer: what a loaded state is checked against

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        *,
        params_dtype: torch.dtype,
        state: ParallelState,
        clip_grad: float,
        cpu_offload: bool = False,
    ):
        self.state, self.clip_grad = state, clip_grad
        self.model_groups = param_groups(model)
        self.kind = cfg.optimizer
        self.offload = cpu_offload
        # Separate fp32 masters: for half weights, and for any weights when they live on the CPU.
        self.masters = params_dtype in (torch.float16, torch.bfloat16) or cpu_offload
        self._holders: list[torch.Tensor] | None = None
        if self.masters:
            where = "cpu" if cpu_offload else None
            main_groups = [
                {**g, "params": [_fp32_copy(p, where) for p in g["params"]]}
                for g in self.model_groups
            ]
        else:
            main_groups = [dict(g) for g in self.model_groups]
        if cfg.optimizer == "muon":
            self.optimizer = self._muon(model, main_groups, cfg)
        else:
            self.optimizer = _torch_optimizer(main_groups, cfg)
        self.scaler = make_grad_scaler(cfg, params_dtype)

    def _muon(self, model: nn.Module, main_groups: list[dict], cfg: OptimizerConfig):
        """--optimizer muon: the transformer layers' matrices take Muon (each main whole and
        TP-gathered, megatron.training.muon), the rest AdamW."""
        settings = muon_settings(cfg)
        layouts = matrix_layouts(model, settings)
        mains = {}
        for model_g, main_g in zip(self.model_groups, main_groups, strict=True):
            for model_p, main_p in zip(model_g["params"], main_g["params"], strict=True):
                if id(model_p) in layouts:
                    mains[id(main_p)] = (main_p, layouts[id(model_p)])
        orthogonalizer = WholeMatrices(
            {k: layout for k, (_, layout) in mains.items()}, settings, self.state.tp_group
        )
        return build_muon(main_groups, cfg, [m for m, _ in mains.values()], orthogonalizer)

    @property
    def skip_on_device(self) -> bool:
        """Whether step() decides the skip on the device (no host read; see the module doc)."""
        dynamic = isinstance(self.scaler, DynamicGradScaler)
        return takes_found_inf(self.optimizer) and not dynamic and not self.offload

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler else loss

    def _pairs(self):
        for model_g, main_g in zip(self.model_groups, self.optimizer.param_groups, strict=True):
            yield from zip(model_g["params"], main_g["params"], strict=True)

    def _unscale_and_check(self, grads: list[torch.Tensor], loss=None) -> torch.Tensor:
        """Divide by the loss scale and test for inf/NaN in one pass (and the loss, if given);
        a device flag, > 0 on every rank if any rank found one. No host read here."""
        device = grads[0].device if grads else torch.device("cpu")
        flag = torch.zeros(1, device=device)
        inv_scale = torch.full((1,), 1.0 / self.loss_scale, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale)
        if loss is not None:  # equal on every rank already; folded in before the reduction
            flag = torch.maximum(flag, (~torch.isfinite(loss.detach())).float().reshape(1))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank skips together
        return flag

    @torch.no_grad()
    def step(self, *, loss: torch.Tensor | None = None) -> tuple[Flag, Norm]:
        """Update unless a gradient, the gradient norm or the loss (a device scalar, equal on
        every rank) is inf/NaN; skipping is global. Returns (updated?, grad norm): python
        values after one host read, or with `skip_on_device` 0-d device tensors (the norm NaN
        where a python one would be None)."""
        try:
            return self._step(loss)
        finally:
            # Drop the aliases of main_grad: for fp32 models main params are the model's, and a
            # .grad left set would make autograd accumulate the next gradient into it directly.
            for carrier in [main_p for _, main_p in self._pairs()] + (self._holders or []):
                carrier.grad = None

    def _grad_carriers(self) -> list[torch.Tensor]:
        """Tensors whose .grad is each fp32 main_grad, on the gradients' device, with the mpu
        attributes: the main params themselves, or (offload: the masters are on the CPU)
        stand-ins aliasing main_grad, so the norm and its all-reduce run where the grads are."""
        if not self.offload:
            carriers = [main_p for _, main_p in self._pairs()]
        else:
            if self._holders is None:
                self._holders = [
                    _with_parallel_attrs(model_p.main_grad.detach(), model_p)
                    for model_p, _ in self._pairs()
                ]
            carriers = self._holders
        for (model_p, _), carrier in zip(self._pairs(), carriers, strict=True):
            carrier.grad = model_p.main_grad  # fp32 view of the DP-reduced gradient, no copy
        return carriers

    def _step(self, loss: torch.Tensor | None) -> tuple[bool, float | None]:
        carriers = self._grad_carriers()
        grads = [c.grad for c in carriers]
        flag = self._unscale_and_check(grads, loss)
        # The norm (all-reduced over TP x PP; DP ranks hold equal reduced gradients, so it is
        # the same on every rank) and the clipping run on the device whatever the flag says;
        # a step with inf/NaN is dropped below, so its scaled gradients are never used.
        norm = clip_grad_norm(
            carriers,
            self.clip_grad,
            tp_rank=self.state.tp_rank,
            model_parallel_group=self.state.mp_group,
            expert_group=self.state.ep_group,
        )
        if self.skip_on_device:
            return self._update_unless(flag, norm)
        found_inf, norm = read_skip_and_norm(flag, norm)  # the step's one host read
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            return False, norm
        if self.offload:
            for (_, main_p), carrier in zip(self._pairs(), carriers, strict=True):
                main_p.grad = carrier.grad.to(main_p.device)  # the clipped gradient, on the CPU
        self.optimizer.step()
        self._after_update()
        return True, norm

    def _update_unless(self, flag: torch.Tensor, norm: torch.Tensor):
        """The update, skipped on the device where `flag` (the gradients' and loss's inf/NaN
        check) or the norm says so: fused AdamW's found_inf leaves everything as it was, and
        the copies after it then copy unchanged weights. Returns device (updated?, norm)."""
        skip = torch.maximum(flag.reshape(()), (~torch.isfinite(norm)).to(flag.dtype))
        self.optimizer.found_inf = skip  # 0-d, 1.0 = skip; read by torch's fused AdamW
        try:
            self.optimizer.step()
        finally:
            self.optimizer.found_inf = None
        self._after_update()
        nan = torch.full_like(norm, float("nan"))  # "no norm" (python None), as the host path
        return skip == 0, torch.where(flag.reshape(()) > 0, nan, norm)

    def _after_update(self) -> None:
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

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading weights without optimizer)."""
        if self.masters:
            for model_p, main_p in self._pairs():
                main_p.copy_(model_p)

    def state_dict(self) -> dict:
        sd = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            sd["grad_scaler"] = self.scaler.state_dict()
        if self.masters:
            sd["fp32_from_fp16_params"] = [p for _, p in self._pairs()]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if self.kind is not None:  # torch's state is keyed by position
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            saved = sd["optimizer"]["state"].items()
            check_state_kind(self.optimizer, self.kind, [(params[i], st) for i, st in saved])
        self.optimizer.load_state_dict(sd["optimizer"])
        if self.scaler is not None and "grad_scaler" in sd:
            self.scaler.load_state_dict(sd["grad_scaler"])
        if self.masters and "fp32_from_fp16_params" in sd:
            for (_, main_p), saved in zip(self._pairs(), sd["fp32_from_fp16_params"], strict=True):
                main_p.copy_(saved)


Flag = bool | torch.Tensor  # updated?: a python bool, or a 0-d bool tensor on the device
Norm = float | None | torch.Tensor  # the grad norm: a python value, or a 0-d device tensor


def read_skip_and_norm(flag: torch.Tensor, norm: torch.Tensor) -> tuple[bool, float | None]:
    """One device-to-host copy for the skip decision: (skip?, the norm to log). The norm is
    None when the gradients or the loss were inf/NaN (it was not a real norm), and kept when
    only the norm itself is non-finite (it overflowed while summing)."""
    flag_value, norm_value = torch.stack([flag.reshape(()).double(), norm.double()]).tolist()
    if flag_value > 0:
        return True, None
    return not math.isfinite(norm_value), norm_value

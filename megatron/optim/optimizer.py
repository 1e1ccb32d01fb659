"""The optimizer step every backend shares: fp32 pieces (where they live is the backend's:
megatron.optim.plain, .distributed, .fsdp2), the torch optimizer of --optimizer over them
(megatron.config.optimizers), fp16 loss scaling and a global skip on inf/NaN.

Gradients arrive in fp32 (each parameter's `main_grad`, megatron.data_parallel.ddp, or its shard of
the buckets). Before each step, one scalar all-reduce over all ranks decides whether any
gradient is inf/NaN: if so every rank skips the update together (and fp16 lowers its loss
scale). The same happens, in every precision, when the caller reports a non-finite loss or the
gradient norm is not finite (finite gradients whose squares overflow): Adam would otherwise
turn such a step into a full-size update of every weight.

Where the torch optimizer takes the decision as an input (fused AdamW's `found_inf`: its kernel
then leaves weights, moments and step count as they were), the decision stays on the device:
step() returns device tensors (updated?, norm), the host never waits for the gradients, and the
caller reads them when it logs. Elsewhere (SGD, apex, --cpu-optimizer, and a dynamic fp16 loss
scale, whose next value the host needs) the host reads the decision once per step.

A backend ("pieces") provides: `groups()` (torch param groups of its fp32 mains), `feed()`
(megatron.optim.matrices.Feed), `grads()` (each main's gradient, attached as its .grad),
`norm_and_clip(grads, clip)`, `before_update()`, `after_update()` (the updated mains into the
model's weights), `release()`, `reload_model_params()`, `state_dict(optimizer, scaler)`,
`load_state_dict(optimizer, sd, shards, check)` (calling `check` on the restored states),
`offload`, `masters`, `sharded` and `state` (the ParallelState); the sharded ones also
`shard_state_dict(optimizer)`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.config.schema_optimizer import OptimizerConfig
from megatron.optim.build import build_torch_optimizer, check_state_kind, takes_found_inf
from megatron.optim.scaler import DynamicGradScaler, make_grad_scaler


class MegatronOptimizer:
    """step() -> (updated?, grad norm or None). Skips are global and counted by the caller."""

    def __init__(self, pieces, cfg: OptimizerConfig, *, params_dtype: torch.dtype, clip_grad):
        self.pieces, self.clip_grad = pieces, clip_grad
        self.kind = cfg.optimizer  # --optimizer: what a loaded state is checked against
        self.optimizer = build_torch_optimizer(pieces.groups(), cfg, pieces.feed())
        self.scaler = make_grad_scaler(cfg, params_dtype)

    @property
    def state(self):
        """The ParallelState of the pieces."""
        return self.pieces.state

    @property
    def masters(self) -> bool:
        """Whether the fp32 mains are copies of the weights (half models, offload)."""
        return self.pieces.masters

    @property
    def sharded(self) -> bool:
        """Whether this rank holds a shard of the state (the distributed optimizer's form)."""
        return self.pieces.sharded

    @property
    def skip_on_device(self) -> bool:
        """Whether step() decides the skip on the device (no host read; see the module doc)."""
        dynamic = isinstance(self.scaler, DynamicGradScaler)
        return takes_found_inf(self.optimizer) and not dynamic and not self.pieces.offload

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler else loss

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
            self.pieces.release()

    def _step(self, loss: torch.Tensor | None) -> tuple[Flag, Norm]:
        grads = self.pieces.grads()
        flag = self._unscale_and_check(grads, loss)
        # The norm (every element counted once over all ranks, so the same on every rank) and
        # the clipping run on the device whatever the flag says; a step with inf/NaN is
        # dropped below, so its scaled gradients are never used.
        norm = self.pieces.norm_and_clip(grads, self.clip_grad)
        if self.skip_on_device:
            return self._update_unless(flag, norm)
        found_inf, norm = read_skip_and_norm(flag, norm)  # the step's one host read
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            return False, norm
        self.pieces.before_update()
        self.optimizer.step()
        self.pieces.after_update()
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
        self.pieces.after_update()
        nan = torch.full_like(norm, float("nan"))  # "no norm" (python None), as the host path
        return skip == 0, torch.where(flag.reshape(()) > 0, nan, norm)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 mains from the model (after loading weights without optimizer)."""
        self.pieces.reload_model_params()

    def state_dict(self) -> dict:
        """The backend's form (plain: torch's state keyed by position; sharded: the part every
        DP rank shares, `shard_state_dict` the rest)."""
        return self.pieces.state_dict(self.optimizer, self.scaler)

    def shard_state_dict(self) -> dict:
        """This DP rank's ranges (sharded backends only)."""
        return self.pieces.shard_state_dict(self.optimizer)

    @torch.no_grad()
    def load_state_dict(self, sd: dict, shards: list[dict] | None = None) -> None:
        """Restore from a state dict of this backend's form (a sharded backend also reads the
        plain form, and the saved DP ranks' `shards`); refused if another --optimizer saved
        it, on every backend (megatron.config.optimizers' state keys)."""
        self.pieces.load_state_dict(self.optimizer, sd, shards, self._check_kind)
        if self.scaler is not None and "grad_scaler" in sd:
            self.scaler.load_state_dict(sd["grad_scaler"])

    def _check_kind(self, states=None) -> None:
        check_state_kind(self.optimizer, self.kind, states)


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

"""Learning-rate schedule, following Megatron's OptimizerParamScheduler.

With n = steps done, W = warmup_steps, D = decay_steps:

    n <= W (W > 0)               lr = init_lr + (max_lr - init_lr) * n / W
    'constant'                   lr = max_lr
    'exponential' (v1.x)         lr = max(min_lr, max_lr * exp(-0.693 * min(r, 1))),
                                 r = (n - W) / (D - W): halves over the decay, then stays
                                 (v1.x's formula when W = 0)
    n > D                        lr = min_lr
    'inverse-square-root'        lr = max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise, r = (n - W) / (D - W) and lr = min_lr + c * (max_lr - min_lr) with
      'linear'  c = 1 - r
      'cosine'  c = (cos(pi * r) + 1) / 2
      'WSD'     c = 1 until n = D - S (S = wsd_decay_steps), then with s = (n - D + S) / S
                c = 1 - s | (cos(pi * s) + 1) / 2 | 2 * 0.5**s - 1 | 1 - sqrt(s)
                for wsd_decay_style linear | cosine | exponential | minus_sqrt.

The first update runs with n = 0, so with warmup it uses init_lr (--lr-warmup-init, default 0):
Megatron-LM's OptimizerParamScheduler does the same (step(0) when built, step(increment) after
each successful optimizer step). nanoGPT's first update uses lr / (warmup + 1) instead; pass
--lr-warmup-init to start above 0.

A "step" is whatever unit the trainer counts: an iteration (step() after each optimizer step),
or a sample under --train-samples (step(increment=global_batch_size)); the flags' meaning in steps
is megatron.config.lr_schedule's. The flags themselves are checked once, by
megatron.config.rules; the checks here guard the constructor's own arguments (and a loaded
checkpoint's schedule) and name those arguments.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron.config.schema_optimizer import LR_DECAY_STYLES, LR_WSD_DECAY_STYLES

# Annealing coefficient after a fraction r of an annealing phase: 1 at r = 0, 0 at r = 1.
_ANNEAL = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: 2.0 * 0.5**r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}

# Fields that define the schedule; saved by state_dict() and compared on load.
_SCHEDULE_FIELDS = tuple(
    "max_lr min_lr warmup_steps decay_steps decay_style wsd_decay_steps wsd_decay_style".split()
)
# Key names of classic (2020) and of current Megatron checkpoints.
_LEGACY_KEYS = {
    "num_iters": "num_steps",
    "warmup_iter": "warmup_steps",
    "end_iter": "decay_steps",
    "start_lr": "max_lr",
    "lr_warmup_steps": "warmup_steps",
    "lr_decay_steps": "decay_steps",
    "lr_decay_style": "decay_style",
    "lr_wsd_decay_style": "wsd_decay_style",
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class AnnealingLR(torch.optim.lr_scheduler._LRScheduler):
    """Warmup then decay of lr, set on every param group.

    Step convention: `num_steps` (== torch's `last_epoch`) counts the steps already done. A fresh
    scheduler has num_steps = 0 and the groups hold get_lr(0); call step() after each optimizer
    step, so the k-th optimizer step (0-based) runs with get_lr(k * increment). Each group gets
    lr * group.get('lr_mult', 1); weight decay stays what the optimizer was built with.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        warmup_steps: int = 0,
        decay_steps: int,
        decay_style: str = "linear",
        wsd_decay_steps: int | None = None,
        wsd_decay_style: str = "exponential",
        override_lr_scheduler: bool = False,
        use_checkpoint_lr_scheduler: bool = False,
    ) -> None:
        _check(
            not (override_lr_scheduler and use_checkpoint_lr_scheduler),
            "override_lr_scheduler and use_checkpoint_lr_scheduler exclude each other",
        )
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.override_lr_scheduler = override_lr_scheduler
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self._validate()
        self.num_steps = 0
        super().__init__(optimizer)  # sets last_epoch = -1, then calls self.step() once

    def _validate(self) -> None:
        warm, decay, wsd = self.warmup_steps, self.decay_steps, self.wsd_decay_steps
        _check(
            0.0 <= self.min_lr <= self.max_lr,
            f"need 0 <= min_lr <= max_lr, got min_lr {self.min_lr} and max_lr {self.max_lr}",
        )
        _check(
            0.0 <= self.init_lr <= self.max_lr,
            f"need 0 <= init_lr <= max_lr, got init_lr {self.init_lr} and max_lr {self.max_lr}",
        )
        _check(self.decay_style in LR_DECAY_STYLES, f"decay_style not in {LR_DECAY_STYLES}")
        _check(decay > 0, f"decay_steps must be > 0, got {decay}")
        _check(warm >= 0, f"warmup_steps must be >= 0, got {warm}")
        _check(
            self.decay_style == "constant" or warm < decay,
            f"warmup_steps {warm} must be fewer than decay_steps {decay}",
        )
        if self.decay_style == "WSD":
            _check(
                wsd is not None and 0 < wsd <= decay - warm,
                f"decay_style WSD needs wsd_decay_steps in (0, {decay - warm}], got {wsd}",
            )
            _check(
                self.wsd_decay_style in LR_WSD_DECAY_STYLES,
                f"wsd_decay_style not in {LR_WSD_DECAY_STYLES}",
            )

    def get_lr(self, num_steps: int | None = None) -> float:  # type: ignore[override]
        """The base lr (before lr_mult) after `num_steps` steps (default: the current count).

        Unlike torch's get_lr(), this returns one float; get_last_lr() has the per-group list.
        """
        n = self.num_steps if num_steps is None else num_steps
        w, d = self.warmup_steps, self.decay_steps
        if w > 0 and n <= w:
            return self.init_lr + (self.max_lr - self.init_lr) * n / w
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "exponential":  # exp(-0.693) = 1/2, v1.x's constant
            r = min(n - w, d - w) / (d - w)
            return max(self.min_lr, self.max_lr * math.exp(-0.693 * r))
        if n > d:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(w, 1)) / math.sqrt(max(n, 1)))
        s = self.wsd_decay_steps
        if self.decay_style != "WSD":  # linear or cosine over the whole decay phase
            coeff = _ANNEAL[self.decay_style]((n - w) / (d - w))
        elif n <= d - s:  # WSD: stable at max_lr, then anneal over the last s steps
            coeff = 1.0
        else:
            coeff = _ANNEAL[self.wsd_decay_style]((n - d + s) / s)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    # What a bare step() counts: 1 per iteration, or the global batch when steps are samples
    # (set by the trainer; DeepSpeed's pipeline engine calls step() without arguments).
    default_increment: int = 1

    def step(self, increment: int | None = None) -> None:  # type: ignore[override]
        """Record `increment` more steps done and set lr on every param group."""
        increment = self.default_increment if increment is None else increment
        _check(increment >= 0, f"step increment must be >= 0, got {increment}")
        if self.last_epoch >= 0:  # torch's __init__ call (last_epoch -1) only installs step 0
            self.num_steps += increment
        self._apply()

    def take_back(self, steps: int) -> None:
        """Undo `steps` bare step() calls (their optimizer steps turned out skipped)."""
        _check(steps >= 0, f"take_back needs steps >= 0, got {steps}")
        self.num_steps -= steps * self.default_increment
        self._apply()

    def _apply(self) -> None:
        self.last_epoch = self.num_steps
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Plain python numbers and strings only, so torch.load(weights_only=True) can read it."""
        sd = {name: getattr(self, name) for name in _SCHEDULE_FIELDS}
        sd["num_steps"] = self.num_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's num_steps; its schedule must match unless a flag says.

        --override-lr-scheduler keeps the constructor's schedule, --use-checkpoint-lr-scheduler
        takes the checkpoint's; with neither, any difference raises ValueError.
        """
        sd = {_LEGACY_KEYS.get(k, k): v for k, v in state_dict.items()}
        _check("num_steps" in sd, "lr scheduler checkpoint has no 'num_steps' (or 'num_iters')")
        for name in _SCHEDULE_FIELDS:
            if name not in sd or self.override_lr_scheduler:
                continue  # old checkpoints lack the newer fields
            _check(
                self.use_checkpoint_lr_scheduler or sd[name] == getattr(self, name),
                f"lr scheduler {name}: checkpoint has {sd[name]!r}, this run"
                f" {getattr(self, name)!r}; pass --override-lr-scheduler to keep this run's"
                " value or --use-checkpoint-lr-scheduler to take the checkpoint's",
            )
            setattr(self, name, sd[name])
        try:
            self._validate()
        except ValueError as e:
            raise ValueError(f"the checkpoint's lr scheduler state is invalid: {e}") from None
        self.num_steps = int(sd["num_steps"])
        self._apply()

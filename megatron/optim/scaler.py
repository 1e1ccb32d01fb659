"""fp16's loss scale: static (--loss-scale) or dynamic (halved on overflow, grown when clean)."""

from __future__ import annotations

import torch

from megatron.config.schema_optimizer import OptimizerConfig


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

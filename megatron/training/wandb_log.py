"""--wandb-project: the TensorBoard scalars and the resolved config, also to Weights & Biases.

`wandb` is imported only when a run asks for it (it is an optional dependency and slow to
import). Offline runs (`WANDB_MODE=offline`) write everything under --wandb-save-dir, to upload
later with `wandb sync`.
"""

from __future__ import annotations

import os

import yaml

from megatron.config.schema_logging import LoggingConfig


def wandb_dir(lg: LoggingConfig, save: str | None) -> str:
    if lg.wandb_save_dir:
        return lg.wandb_save_dir
    return os.path.join(save, "wandb") if save else "wandb"


class WandB:
    """A metrics sink (see training/log.py `MetricsSinks`) on the logging rank only."""

    def __init__(self, lg: LoggingConfig, save: str | None, enabled: bool):
        self.run = None
        if not (lg.wandb_project and enabled):
            return
        import wandb

        directory = wandb_dir(lg, save)
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, dir=directory)

    def scalars(self, values: dict[str, float], iteration: int, consumed: int) -> None:
        if self.run is None:
            return
        logged = {name: value for name, value in values.items() if value is not None}
        logged["consumed-samples"] = consumed  # an x axis to pick in the W&B charts
        self.run.log(logged, step=iteration)

    def run_config(self, text: str) -> None:
        """The resolved config (the YAML of SAVE/run_config.yaml) as the run's W&B config."""
        if self.run is not None:
            self.run.config.update(yaml.safe_load(text) or {}, allow_val_change=True)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

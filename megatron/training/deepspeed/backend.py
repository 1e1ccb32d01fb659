"""The trainer's --deepspeed backend: engine steps, evaluation and crash-safe engine checkpoints.

Checkpoints go through `engine.save_checkpoint` (tag `iter_0000100`, our iteration, consumed
samples, RNG states and model arguments in its client state) with DeepSpeed's own non-atomic
`latest` file disabled: after a barrier rank 0 writes our completion marker (every file the
engine wrote, with its size) and replaces `latest_checkpointed_iteration.txt` atomically, so the
pointer only ever names complete checkpoints. Before DeepSpeed unpickles a checkpoint (it loads
with weights_only=False), every file is checked against the marker's CRC-32 (a damaged one makes
the load fall back to an older checkpoint) and test-loaded with weights_only=True: one that
needs arbitrary unpickling is refused.
"""

from __future__ import annotations

import functools
import os

import torch

from megatron.checkpoint.reading import verify_checkpoint_files
from megatron.checkpoint.storage import CheckpointError, checkpoint_dir
from megatron.config.schema import MegatronConfig
from megatron.model.moe import moe_layers
from megatron.training.backend import StepResult, TrainerBackend
from megatron.training.checkpoint_args import check_model_args
from megatron.training.deepspeed.engine import ds_evaluate, ds_train_step, setup_deepspeed
from megatron.training.deepspeed.moe import (
    check_expert_layout,
    expert_parallel_model,
    load_experts,
    save_experts,
)
from megatron.training.state import TrainState, checkpoint_entries, commit, resume
from megatron.training.step import make_scheduler


def _safe_globals():
    """Plain data classes DeepSpeed pickles into its checkpoints (loss-scaler counters, the ZeRO
    stage enum, fragment addresses). weights_only rebuilds them from their attributes without
    running any of their code, so allowing them is safe; nothing else is allowed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def verify_weights_only(directory: str) -> None:
    """Load every .pt under `directory` with weights_only=True; refuse what would run code."""
    for dirpath, _, names in os.walk(directory):
        for name in sorted(names):
            if not name.endswith(".pt"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with torch.serialization.safe_globals(_safe_globals()):
                    torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # UnpicklingError, or a global that is not allowed
                raise CheckpointError(
                    f"{path}: loading it needs arbitrary unpickling, which we refuse "
                    f"(weights_only=True failed: {str(e).splitlines()[0]})"
                ) from None


class DeepSpeedBackend(TrainerBackend):
    """The model, our optimizer and LR schedule in a DeepSpeed engine (ZeRO; its pipeline
    engine for PP > 1)."""

    def __init__(
        self, cfg: MegatronConfig, rt, forward_step_func, model_provider, pipeline_provider=None
    ):
        self.cfg, self.rt, self.forward_step = cfg, rt, forward_step_func
        self.engine, self.scheduler, self.pipeline = setup_deepspeed(
            cfg,
            rt,
            functools.partial(make_scheduler, cfg, rt.state.dp_size),
            model_provider,
            pipeline_provider,
        )
        self.model = self.engine
        self.experts = expert_parallel_model(self.engine.module, rt.state) and not self.pipeline

    @property
    def loss_scale(self) -> float:
        optimizer = self.engine.optimizer
        scale = getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)
        return float(scale) if isinstance(scale, int | float) else 1.0

    def train_step(self, data_iterator, num_micro_batches: int, timers) -> StepResult:
        return ds_train_step(
            self.engine,
            self.pipeline,
            self.forward_step,
            data_iterator,
            num_micro_batches,
            self.rt,
            timers,
        )

    def evaluate(self, data_iterator, eval_iters: int, num_micro_batches: int) -> float:
        return ds_evaluate(
            self.engine,
            self.pipeline,
            self.forward_step,
            data_iterator,
            eval_iters,
            num_micro_batches,
            self.rt,
        )

    def save(self, state: TrainState) -> bool:
        client = checkpoint_entries(self.cfg, self.rt, state)
        tag = os.path.basename(checkpoint_dir(self.cfg.checkpoint.save, state.iteration))
        error = None
        try:  # a failed write is agreed on in commit (DeepSpeed's own barriers permitting)
            self.engine.save_checkpoint(
                self.cfg.checkpoint.save, tag=tag, client_state=client, save_latest=False
            )
            if self.experts:  # DeepSpeed wrote EP rank 0's experts only
                save_experts(
                    self.engine.module, os.path.join(self.cfg.checkpoint.save, tag), self.rt.state
                )
        except OSError as e:
            error = e
        commit(self.cfg, self.rt, state.iteration, error, layout="deepspeed")
        return True

    def load(self) -> TrainState:
        return resume(self.cfg, self.rt, self._verify, self._load_engine)

    def _verify(self, iteration: int) -> None:
        """Every rank checks every file (DeepSpeed reads them all), so all ranks agree."""
        verify_checkpoint_files(self.cfg.checkpoint.load, iteration)
        verify_weights_only(checkpoint_dir(self.cfg.checkpoint.load, iteration))

    def _load_engine(self, iteration: int, _) -> dict:
        """The engine's part of a resume; returns our entries from its client state."""
        c = self.cfg.checkpoint
        directory = checkpoint_dir(c.load, iteration)
        if moe_layers(self.engine.module):
            check_expert_layout(directory, self.rt.state.ep_size)
        path, client = self.engine.load_checkpoint(
            c.load,
            tag=os.path.basename(directory),
            load_optimizer_states=not (c.no_load_optim or c.finetune),
            load_lr_scheduler_states=not (c.no_load_optim or c.finetune),
            load_module_only=c.finetune,
        )
        if path is None:
            raise CheckpointError(f"{directory}: DeepSpeed could not load this checkpoint")
        check_model_args(client or {}, self.cfg, directory)  # before any step runs
        if self.experts:
            refresh = c.no_load_optim or c.finetune  # the optimizer's fp32 copies came from DP 0
            load_experts(self.engine, directory, self.rt.state, refresh_masters=refresh)
        return client

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
import sys

import torch
import torch.distributed as dist

from megatron.checkpoint.storage import (
    CheckpointError,
    checkpoint_dir,
    finalize_checkpoint,
    load_newest_intact,
    rng_state_dict,
    set_rng_state,
    verify_checkpoint_files,
)
from megatron.config.schema import MegatronConfig
from megatron.training.deepspeed.engine import ds_evaluate, ds_train_step, setup_deepspeed
from megatron.training.state import TrainState, checkpoint_args


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


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


class DeepSpeedBackend:
    def __init__(self, cfg: MegatronConfig, rt, forward_step_func):
        from megatron.training.step import make_scheduler

        self.cfg, self.rt, self.forward_step = cfg, rt, forward_step_func
        self.engine, self.scheduler, self.pipeline = setup_deepspeed(
            cfg, rt, functools.partial(make_scheduler, cfg, rt.state.dp_size)
        )
        self.model = self.engine

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @property
    def loss_scale(self) -> float:
        optimizer = self.engine.optimizer
        scale = getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)
        return float(scale) if isinstance(scale, int | float) else 1.0

    def train_step(self, data_iterator, num_micro_batches: int, timers) -> dict:
        return ds_train_step(
            self.engine, self.pipeline, self.forward_step, data_iterator, num_micro_batches, self.rt
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

    def save(self, state: TrainState) -> None:
        root = self.cfg.checkpoint.save
        rng = rng_state_dict(self.rt.device)
        rng["tracker"] = self.rt.rng_tracker.get_states()
        client = {
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "rng_state": rng,
            "args": checkpoint_args(self.cfg),
        }
        tag = os.path.basename(checkpoint_dir(root, state.iteration))
        self.engine.save_checkpoint(root, tag=tag, client_state=client, save_latest=False)
        finalize_checkpoint(
            root,
            state.iteration,
            barrier=_barrier,
            is_rank0=self.rt.state.rank == 0,
            retain_last=self.cfg.checkpoint.save_retain_last,
            layout="deepspeed",
        )

    def load(self) -> TrainState:
        c = self.cfg.checkpoint

        def verify(it: int) -> None:
            # Every rank checks every file (DeepSpeed reads them all), so all agree.
            verify_checkpoint_files(c.load, it)
            verify_weights_only(checkpoint_dir(c.load, it))

        iteration, _ = load_newest_intact(c.load, verify)
        if iteration is None:
            if self.rt.state.rank == 0:
                print(
                    f" no checkpoint in --load {c.load}; starting from iteration 0", file=sys.stderr
                )
            return TrainState()
        directory = checkpoint_dir(c.load, iteration)
        path, client = self.engine.load_checkpoint(
            c.load,
            tag=os.path.basename(directory),
            load_optimizer_states=not (c.no_load_optim or c.finetune),
            load_lr_scheduler_states=not (c.no_load_optim or c.finetune),
            load_module_only=c.finetune,
        )
        if path is None:
            raise CheckpointError(f"{directory}: DeepSpeed could not load this checkpoint")
        if c.finetune:
            return TrainState()
        if not c.no_load_rng:
            set_rng_state(client["rng_state"], self.rt.device)
            self.rt.rng_tracker.set_states(client["rng_state"]["tracker"])
        return TrainState(
            iteration=client["iteration"],
            consumed_train_samples=client["consumed_train_samples"],
            consumed_valid_samples=client["consumed_valid_samples"],
        )

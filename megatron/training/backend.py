"""The trainer's backend contract, and the loss averaging both backends report with.

pretrain()'s loop (megatron/training/train_loop.py) owns the iteration count, consumed samples,
batch-size ramp, logging, evaluation cadence, checkpoint cadence and exit conditions. A backend
owns the model, optimizer and LR schedule and answers the loop through `TrainerBackend` only:

- NativeBackend (megatron/training/step.py): our DDP, MegatronOptimizer and schedules.
- DeepSpeedBackend (megatron/training/deepspeed/backend.py): the same model in a DeepSpeed
  engine (ZeRO, its pipeline engine for PP > 1).

What both need exists once: resume glue and the checkpoint entries every backend writes
(megatron/training/state.py), the batch fetch (megatron/training/data.py get_batch), the
micro-batch loop (megatron/training/schedules.py), the vocab-padding mask (the family's
output head, e.g. megatron/models/gpt/model.py OutputHead.logits), the barrier
(megatron/initialize.py) and the reported loss (`average_loss` below).
"""

from __future__ import annotations

import abc
from typing import NotRequired, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from megatron.initialize import Runtime
from megatron.training.learning_rates import AnnealingLR
from megatron.training.state import TrainState
from megatron.training.timers import Timers


class StepResult(TypedDict):
    """One optimizer step as the loop logs it (the same values on every rank)."""

    lm_loss: torch.Tensor | float  # the global batch's mean loss; a device scalar the loop
    # reads on the host only when it logs (so steps that do not log never wait for the device)
    # False: the step was skipped (inf/NaN gradients or loss, fp16 overflow). A 0-d bool
    # tensor when the skip was decided on the device: the loop reads it with the loss.
    updated: bool | torch.Tensor
    grad_norm: float | None | torch.Tensor  # None where the backend cannot tell (device: NaN)
    other_losses: NotRequired[dict[str, torch.Tensor | float]]  # e.g. {"nsp loss": ...}
    # --fault-tolerance: False when the replica groups dropped the step (nothing changed; the
    # loop redoes it on the same samples)
    committed: NotRequired[bool]
    replicas: NotRequired[list[int]]  # --fault-tolerance: the replica groups that took part


class TrainerBackend(abc.ABC):
    """What the training loop asks of a backend. Subclasses set `model` (handed back to the
    caller in TrainResult.model) and `scheduler` (the AnnealingLR both backends step)."""

    model: nn.Module
    scheduler: AnnealingLR

    @property
    def lr(self) -> float:
        """The learning rate of the next step (the base lr, before any group's lr_mult)."""
        return self.scheduler.get_last_lr()[0]

    @property
    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without one)."""

    @abc.abstractmethod
    def train_step(self, data_iterator, num_micro_batches: int, timers: Timers) -> StepResult:
        """Forward and backward over `num_micro_batches` micro batches, then one optimizer and
        LR-schedule step (unless skipped)."""

    def take_back_schedule(self, steps: int) -> None:
        """`steps` steps whose skip was decided on the device (StepResult["updated"] a tensor)
        turned out skipped: undo the LR schedule's step taken for each, so skipped steps never
        advance it (the loop calls this when it reads them, before any save)."""
        self.scheduler.take_back(steps)

    @abc.abstractmethod
    def evaluate(self, data_iterator, eval_iters: int, num_micro_batches: int) -> float:
        """The mean loss of `eval_iters` global batches, without gradients."""

    @abc.abstractmethod
    def save(self, state: TrainState) -> bool:
        """Write a complete, crash-safe checkpoint of `state.iteration` to --save. True: it is
        committed on return; False: only staged in memory (--async-save), committed at a later
        step, and then listed by `committed_saves`."""

    def committed_saves(self) -> list[int]:
        """The iterations whose staged save has committed since the last call (none for a
        backend that only saves synchronously)."""
        return []

    def wait_for_save(self) -> None:
        """Block until a checkpoint still being written (--async-save) is committed; backends
        that only save synchronously have none, and return at once."""
        return None

    @abc.abstractmethod
    def load(self) -> TrainState:
        """Restore from --load (megatron.training.state.resume); a fresh start without one."""


def global_loss(losses: list[torch.Tensor], rt: Runtime) -> torch.Tensor:
    """The global batch's mean loss as a 0-d tensor on the device, the same on every rank.

    The mean of this rank's micro-batch losses (they exist on the last pipeline stage only),
    averaged over data parallelism, then broadcast from the last stage to every stage, so all
    ranks log, and decide on skips and divergence with, one value. The micro batches all have
    the same size, so the mean of means is the mean over the global batch. Nothing here waits
    for the device: the host reads the value when it logs (`average_loss` reads it at once).
    """
    st = rt.state
    t = torch.zeros(1, device=rt.device)
    if st.holds_loss:
        t = torch.stack([x.detach().float() for x in losses]).mean().reshape(1).to(rt.device)
        if st.dp_size > 1:
            dist.all_reduce(t, group=st.dp_group)
            t /= st.dp_size
    if st.pp_size > 1:
        dist.broadcast(t, st.pp_ranks[st.loss_stage], group=st.pp_group)
    return t.reshape(())


def average_loss(losses: list[torch.Tensor], rt: Runtime) -> float:
    """`global_loss` read on the host (evaluation, which prints it at once)."""
    return float(global_loss(losses, rt).item())


def other_losses(forward_step_func, stats: list[dict], rt: Runtime) -> dict[str, torch.Tensor]:
    """The stats named by `forward_step_func.other_losses` (besides "lm loss"), each averaged
    like the loss. The names come from the function, not from `stats`, because only the last
    pipeline stage has stats and every rank must join the same collectives."""
    names = getattr(forward_step_func, "other_losses", ())
    return {name: global_loss([s[name] for s in stats], rt) for name in names}

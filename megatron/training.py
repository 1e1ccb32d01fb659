"""pretrain(): initialize -> model, optimizer, scheduler, data -> train loop with evaluation,
logging, checkpoints and exit conditions. pretrain_gpt2.py is a thin wrapper around it."""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.config import MegatronConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.distributed import DistributedDataParallel
from megatron.fused_kernels import select_ops
from megatron.initialize import Runtime, initialize_megatron
from megatron.learning_rates import AnnealingLR, scheduler_steps
from megatron.microbatches import MicroBatchCalculator
from megatron.model.stages import build_model
from megatron.optimizer import MegatronOptimizer
from megatron.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.timers import Timers
from megatron.training_data import build_data_iterators, get_batch
from megatron.training_log import (
    TensorBoard,
    iteration_line,
    memory_mib,
    model_flops_per_sample,
    peak_tflops,
    validation_line,
)
from megatron.training_state import TrainState, load_training_state, save_training_state
from megatron.validation import validate_model


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many skipped steps in a row); exit non-zero."""


@dataclass
class TrainResult:
    iteration: int
    exit_reason: str  # "finished" | "exit-interval" | "exit-duration" | "signal"
    history: list[dict] = field(default_factory=list)  # one entry per iteration
    validation: list[dict] = field(default_factory=list)
    model: object = None  # the trained (DDP-wrapped) model of this rank


def forward_step(data_iterator, model):
    """One GPT micro batch: the chunk's output and the loss function for the last stage."""
    tokens, labels, loss_mask = get_batch(data_iterator, _device_of(model))
    output = model(tokens, labels=labels)  # per-token loss (b, s) on the last stage
    return output, functools.partial(lm_loss, loss_mask)


def lm_loss(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """Mean language-model loss over the unmasked tokens of a micro batch."""
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def resolve_vocab(cfg: MegatronConfig):
    """Set the model's vocab from the tokenizer (when one is configured); returns (cfg, tok)."""
    tok_cfg = cfg.data.tokenizer
    if tok_cfg.tokenizer_type is None:
        return cfg, None
    tokenizer = build_tokenizer(
        tok_cfg.tokenizer_type, vocab_size=cfg.model.vocab_size, **tok_cfg.kwargs()
    )
    model = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    validate_model(model, cfg.parallel.tensor_model_parallel_size)
    return cfg.replace(model=model), tokenizer


def setup_model_and_optimizer(cfg: MegatronConfig, rt: Runtime):
    dtype = cfg.precision.params_dtype
    ops = select_ops(cfg.model, rt.device)
    if rt.state.rank == 0:
        print(f" {ops.describe()}", file=sys.stderr, flush=True)
    model = build_model(
        cfg.model,
        rt.state,
        rng_tracker=rt.rng_tracker,
        seed=cfg.training.seed,
        device=rt.device,
        dtype=dtype,
        ops=ops,
    )
    ddp = DistributedDataParallel(
        model,
        rt.state.dp_group,
        bucket_size=cfg.distributed.ddp_bucket_size,
        overlap_grad_reduce=cfg.distributed.overlap_grad_reduce,
    )
    optimizer = MegatronOptimizer(
        model, cfg.optimizer, params_dtype=dtype, state=rt.state, clip_grad=cfg.training.clip_grad
    )
    return ddp, optimizer, make_scheduler(cfg, rt.state.dp_size, optimizer.optimizer)


def make_scheduler(cfg: MegatronConfig, dp_size: int, optimizer) -> AnnealingLR:
    """AnnealingLR from the schedule flags; step() counts iterations or samples as they say."""
    o, t = cfg.optimizer, cfg.training
    steps = scheduler_steps(
        train_iters=t.train_iters,
        train_samples=t.train_samples,
        global_batch_size=t.resolved_global_batch_size(dp_size),
        lr_decay_iters=o.lr_decay_iters,
        lr_decay_samples=o.lr_decay_samples,
        lr_warmup_iters=o.lr_warmup_iters,
        lr_warmup_samples=o.lr_warmup_samples,
        lr_warmup_fraction=o.lr_warmup_fraction,
        warmup=o.warmup,
        lr_wsd_decay_iters=o.lr_wsd_decay_iters,
        lr_wsd_decay_samples=o.lr_wsd_decay_samples,
    )
    scheduler = AnnealingLR(
        optimizer,
        max_lr=o.lr,
        min_lr=o.min_lr,
        warmup_steps=steps["warmup_steps"],
        decay_steps=steps["decay_steps"],
        decay_style=o.lr_decay_style,
        wsd_decay_steps=steps["wsd_decay_steps"],
        wsd_decay_style=o.lr_wsd_decay_style,
        override_lr_scheduler=o.override_lr_scheduler,
        use_checkpoint_lr_scheduler=o.use_checkpoint_lr_scheduler,
    )
    scheduler.default_increment = steps["increment"]
    return scheduler


class _ExitSignal:
    """Remembers a SIGTERM; ranks agree on it at the next iteration boundary."""

    def __init__(self, enabled: bool):
        self.received = False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True


def _any_rank(flags: list[bool], device) -> list[bool]:
    t = torch.tensor([float(f) for f in flags], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def _reported_loss(stats: list[dict], rt: Runtime) -> float:
    """Mean loss of the global batch: averaged over DP on the last stage, then sent to all
    pipeline stages so every rank logs (and decides on) the same number."""
    st = rt.state
    t = torch.zeros(1, device=rt.device)
    if st.is_last_stage:
        t = torch.stack([s["lm loss"].float() for s in stats]).mean().reshape(1).to(rt.device)
        if st.dp_size > 1:
            dist.all_reduce(t, group=st.dp_group)
            t /= st.dp_size
    if st.pp_size > 1:
        dist.broadcast(t, st.pp_ranks[-1], group=st.pp_group)
    return float(t.item())


def sync_embedding_grads(model, state) -> None:
    """Tied embeddings on the first and last stage: sum their gradients so both copies take
    the same step and stay equal."""
    if state.pp_size == 1 or state.embedding_group is None:
        return
    weight = model.module.word_embeddings_weight()
    if weight is not None:
        dist.all_reduce(weight.main_grad, group=state.embedding_group)


def _schedule(cfg: MegatronConfig, rt: Runtime):
    return get_forward_backward_func(
        rt.state,
        micro_batch_size=cfg.training.micro_batch_size,
        seq_length=cfg.model.seq_length,
        hidden_size=cfg.model.hidden_size,
        dtype=cfg.precision.params_dtype,
    )


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    scheduler,
    num_micro_batches,
    rt: Runtime,
    timers: Timers,
    schedule=None,
    report: dict | None = None,
) -> dict:
    """One optimizer step over the global batch; returns the loss, whether it updated, norm."""
    model.zero_grad_buffer()
    schedule = schedule or forward_backward_no_pipelining
    stats = schedule(
        forward_step_func,
        data_iterator,
        model,
        num_micro_batches,
        scale_loss=optimizer.scale_loss,
        timers=timers,
        report=report,
    )
    timers("grads-all-reduce", 2).start()
    model.finish_grad_sync()
    sync_embedding_grads(model, rt.state)
    timers("grads-all-reduce", 2).stop()
    timers("optimizer", 1).start()
    updated, grad_norm = optimizer.step()
    timers("optimizer", 1).stop()
    if updated:
        scheduler.step()  # by its default_increment: 1 iteration, or the global batch
    return {"lm_loss": _reported_loss(stats, rt), "updated": updated, "grad_norm": grad_norm}


@torch.no_grad()
def evaluate(
    forward_step_func, data_iterator, model, eval_iters, num_micro_batches, rt, schedule=None
) -> float:
    model.eval()
    schedule = schedule or forward_backward_no_pipelining
    stats = []
    for _ in range(eval_iters):
        stats += schedule(
            forward_step_func, data_iterator, model, num_micro_batches, forward_only=True
        )
    model.train()
    return _reported_loss(stats, rt)


def pretrain(
    cfg: MegatronConfig,
    *,
    forward_step_func=forward_step,
    runtime: Runtime | None = None,
    out=sys.stdout,
) -> TrainResult:
    """Train as the config says; returns the per-iteration history (the last rank logs it)."""
    cfg, _ = resolve_vocab(cfg)
    rt = runtime or initialize_megatron(cfg)
    if cfg.deepspeed.enabled:
        from megatron.deepspeed_backend import DeepSpeedBackend

        backend = DeepSpeedBackend(cfg, rt, forward_step_func)
    else:
        backend = NativeBackend(cfg, rt, forward_step_func)
    state = backend.load() if cfg.checkpoint.load else TrainState()
    iters = build_data_iterators(
        cfg, rt, state.consumed_train_samples, state.consumed_valid_samples
    )
    loop = _TrainLoop(cfg, rt, backend, out)
    try:
        result = loop.run(state, *iters)
        result.model = backend.model
        return result
    finally:
        loop.tensorboard.close()


class NativeBackend:
    """Our own TP x PP x DP: DistributedDataParallel, MegatronOptimizer, our schedules."""

    def __init__(self, cfg: MegatronConfig, rt: Runtime, forward_step_func):
        self.cfg, self.rt, self.forward_step = cfg, rt, forward_step_func
        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(cfg, rt)
        self.schedule = _schedule(cfg, rt)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    def train_step(self, data_iterator, num_micro_batches: int, timers: Timers) -> dict:
        return train_step(
            self.forward_step,
            data_iterator,
            self.model,
            self.optimizer,
            self.scheduler,
            num_micro_batches,
            self.rt,
            timers,
            self.schedule,
        )

    def evaluate(self, data_iterator, eval_iters: int, num_micro_batches: int) -> float:
        return evaluate(
            self.forward_step,
            data_iterator,
            self.model,
            eval_iters,
            num_micro_batches,
            self.rt,
            self.schedule,
        )

    def save(self, state: TrainState) -> None:
        save_training_state(self.cfg, self.rt, self.model, self.optimizer, self.scheduler, state)

    def load(self) -> TrainState:
        return load_training_state(self.cfg, self.rt, self.model, self.optimizer, self.scheduler)


@dataclass
class _Window:
    """What happened since the last log line."""

    iters: int = 0
    seconds: float = 0.0
    skipped: int = 0
    nan: int = 0
    loss_sum: float = 0.0
    counted: int = 0
    grad_norm: float | None = None

    def add(self, step: dict, seconds: float) -> None:
        self.iters += 1
        self.seconds += seconds
        self.skipped += not step["updated"]
        if math.isfinite(step["lm_loss"]):
            self.loss_sum += step["lm_loss"]
            self.counted += 1
        else:
            self.nan += 1
        if step["grad_norm"] is not None:
            self.grad_norm = step["grad_norm"]


class _TrainLoop:
    def __init__(self, cfg, rt, backend, out):
        self.cfg, self.rt, self.backend, self.out = cfg, rt, backend, out
        t = cfg.training
        self.micro = MicroBatchCalculator(
            t.resolved_global_batch_size(rt.state.dp_size),
            t.micro_batch_size,
            rt.state.dp_size,
            t.rampup_batch_size,
        )
        self.is_logger = rt.state.rank == rt.state.world_size - 1
        self.tensorboard = TensorBoard(cfg.logging.tensorboard_dir, self.is_logger)
        self.timers = Timers(cfg.logging.timing_log_level, rt.device)
        self.signal = _ExitSignal(t.exit_signal_handler)
        self.flops_per_sample = model_flops_per_sample(cfg.model, cfg.model.seq_length)
        self.peak = peak_tflops(rt.device, cfg.logging.peak_tflops)
        self.skipped_in_a_row = 0

    def _print(self, line: str) -> None:
        if self.is_logger:
            print(line, file=self.out, flush=True)

    def _done(self, state: TrainState) -> bool:
        t = self.cfg.training
        if t.train_iters is not None:
            return state.iteration >= t.train_iters
        return state.consumed_train_samples >= t.train_samples

    def _total_iters(self) -> int:
        t = self.cfg.training
        if t.train_iters is not None:
            return t.train_iters
        return -(-t.train_samples // self.micro.global_batch_size)

    def run(self, state: TrainState, train_iter, valid_iter, test_iter) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        result = TrainResult(iteration=state.iteration, exit_reason="finished")
        start_time = time.monotonic()
        window = _Window()
        while not self._done(state):
            gbs = self._iteration(state, train_iter, window, result)
            if state.iteration % cfg.logging.log_interval == 0:
                self._log(state, gbs, window)
                window = _Window()
            if valid_iter is not None and t.eval_iters and state.iteration % t.eval_interval == 0:
                self._validate(state, valid_iter, result, "validation")
            reason = self._exit_reason(state, start_time)
            interval = cfg.checkpoint.save_interval
            if reason or (interval and state.iteration % interval == 0) or self._done(state):
                self._save(state)
            if reason:
                result.exit_reason = reason
                break
        if result.exit_reason == "finished" and t.eval_iters:
            if valid_iter is not None and state.iteration % t.eval_interval:
                self._validate(state, valid_iter, result, "validation")  # not just done
            if test_iter is not None:
                self._validate(state, test_iter, result, "test")
        result.iteration = state.iteration
        return result

    def _iteration(self, state: TrainState, train_iter, window: _Window, result) -> int:
        gbs = self.micro.global_batch_at(state.consumed_train_samples)
        tic = time.perf_counter()
        self.timers("iteration").start()
        step = self.backend.train_step(
            train_iter, self.micro.num_micro_batches(state.consumed_train_samples), self.timers
        )
        self.timers("iteration").stop()
        state.iteration += 1
        state.consumed_train_samples += gbs
        window.add(step, time.perf_counter() - tic)
        self.skipped_in_a_row = 0 if step["updated"] else self.skipped_in_a_row + 1
        result.history.append(
            {
                "iteration": state.iteration,
                "lm_loss": step["lm_loss"],
                "grad_norm": step["grad_norm"],
                "updated": step["updated"],
                "lr": self.backend.lr,
                "loss_scale": self.backend.loss_scale,
            }
        )
        limit = self.cfg.training.max_skipped_in_a_row
        if self.skipped_in_a_row >= limit:
            raise TrainingError(
                f"{self.skipped_in_a_row} iterations in a row were skipped (inf/NaN gradients "
                f"or loss) up to iteration {state.iteration}; the run is diverging. Lower --lr, "
                "check the data, or raise --max-skipped-in-a-row"
            )
        return gbs

    def _exit_reason(self, state: TrainState, start_time: float) -> str | None:
        t = self.cfg.training
        if t.exit_interval and state.iteration % t.exit_interval == 0:
            return "exit-interval"
        if not (t.exit_signal_handler or t.exit_duration_in_mins):
            return None
        over_time = bool(t.exit_duration_in_mins) and (
            time.monotonic() - start_time > 60.0 * t.exit_duration_in_mins
        )
        signal_any, time_any = _any_rank([self.signal.received, over_time], self.rt.device)
        if signal_any:
            self._print(f" exiting on SIGTERM at iteration {state.iteration} (saving first)")
            return "signal"
        return "exit-duration" if time_any else None

    def _save(self, state: TrainState) -> None:
        if not self.cfg.checkpoint.save:
            return
        self.timers("save-checkpoint", 0).start()
        self.backend.save(state)
        self.timers("save-checkpoint", 0).stop()
        self._print(
            f" saved checkpoint at iteration {state.iteration} to {self.cfg.checkpoint.save}"
        )

    def _validate(self, state, data_iter, result, split: str) -> None:
        num_micro = self.micro.num_micro_batches(state.consumed_train_samples)
        loss = self.backend.evaluate(data_iter, self.cfg.training.eval_iters, num_micro)
        if split == "validation":
            state.consumed_valid_samples += (
                self.cfg.training.eval_iters
                * self.micro.global_batch_at(state.consumed_train_samples)
            )
        result.validation.append({"iteration": state.iteration, "split": split, "lm_loss": loss})
        bar = "-" * 100
        self._print(f"{bar}\n{validation_line(state.iteration, loss, split)}\n{bar}")
        self.tensorboard.scalars(
            {f"{split} lm-loss": loss}, state.iteration, state.consumed_train_samples
        )

    def _log(self, state: TrainState, gbs: int, w: _Window) -> None:
        iters = max(w.iters, 1)
        sec = w.seconds / iters
        loss = w.loss_sum / w.counted if w.counted else float("nan")
        tokens_per_s = gbs * self.cfg.model.seq_length / max(sec, 1e-9)
        tflops = gbs * self.flops_per_sample / max(sec, 1e-9) / self.rt.state.world_size / 1e12
        mfu = 100.0 * tflops / self.peak if self.peak else None
        grad_norm = w.grad_norm
        lr = self.backend.lr
        self._print(
            iteration_line(
                iteration=state.iteration,
                train_iters=self._total_iters(),
                consumed=state.consumed_train_samples,
                ms_per_iter=1000.0 * sec,
                lr=lr,
                global_batch=gbs,
                loss=loss,
                loss_scale=self.backend.loss_scale,
                grad_norm=grad_norm,
                skipped=w.skipped,
                nan=w.nan,
                tokens_per_s=tokens_per_s,
                tflops=tflops,
                mfu=mfu,
            )
        )
        if self.cfg.logging.timing_log_level > 0:
            self._print(Timers.format(self.timers.pop_elapsed(), iters))
        self.tensorboard.scalars(
            {
                "lm-loss": loss,
                "learning-rate": lr,
                "loss-scale": self.backend.loss_scale,
                "tokens-per-second": tokens_per_s,
                "tflops-per-device": tflops,
                "memory-mib": memory_mib(self.rt.device),
            },
            state.iteration,
            state.consumed_train_samples,
        )

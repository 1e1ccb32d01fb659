"""TrainLoop: the iterations of a training run that pretrain() (megatron/training/loop.py) has
set up: each step through the backend, the log lines and metrics, evaluation, checkpoint saves
and the exit conditions (--train-iters/--train-samples, --exit-interval, --exit-duration-in-mins,
SIGTERM, too many skipped steps in a row, a run that ends on non-finite steps)."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.config.schema import MegatronConfig
from megatron.initialize import Runtime
from megatron.resilience.fault_tolerance import batch_share
from megatron.resilience.straggler import straggler_detector
from megatron.training.backend import TrainerBackend
from megatron.training.log import (
    build_metrics_sinks,
    iteration_line,
    loss_scale_warmup_line,
    memory_mib,
    model_flops_per_sample,
    peak_tflops,
    validation_line,
)
from megatron.training.microbatches import MicroBatchCalculator
from megatron.training.profiling import Profiler
from megatron.training.state import TrainState
from megatron.training.timers import Timers
from megatron.training.window import Window


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many skipped steps in a row); exit non-zero."""


@dataclass
class TrainResult:
    iteration: int
    exit_reason: str  # "finished" | "exit-interval" | "exit-duration" | "signal"
    history: list[dict] = field(default_factory=list)  # one entry per iteration
    validation: list[dict] = field(default_factory=list)
    model: object = None  # the trained (DDP-wrapped) model of this rank


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


class TrainLoop:
    """The loop of one run on this rank: run() steps until a limit or an exit condition."""

    def __init__(self, cfg: MegatronConfig, rt: Runtime, backend: TrainerBackend, out):
        self.cfg, self.rt, self.backend, self.out = cfg, rt, backend, out
        t = cfg.training
        _, dp_size = batch_share(cfg, rt.state)  # --fault-tolerance: the replica groups
        self.micro = MicroBatchCalculator(
            t.resolved_global_batch_size(dp_size), t.micro_batch_size, dp_size, t.rampup_batch_size
        )
        self.is_logger = rt.state.rank == rt.state.world_size - 1
        self.metrics = build_metrics_sinks(cfg.logging, cfg.checkpoint.save, self.is_logger)
        self.timers = Timers(cfg.logging.timing_log_level, rt.device)
        self.profiler = Profiler(cfg.logging, rt.state.rank, rt.device, self.timers, out)
        self.stragglers = straggler_detector(cfg.logging, rt, out)
        self.timers.sections = self.stragglers
        # until a first step settles: fp16's dynamic loss scale may skip it (_say_scale_warmup)
        self.watch_scale_warmup = cfg.precision.fp16 and not cfg.optimizer.loss_scale
        self.signal = _ExitSignal(t.exit_signal_handler)
        self.flops_per_sample = model_flops_per_sample(cfg.model, cfg.model.seq_length)
        self.peak = peak_tflops(rt.device, cfg.logging.peak_tflops)
        self.skipped_in_a_row = 0
        self.nonfinite_in_a_row = 0  # of those, skipped with a non-finite loss

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
        window = Window()
        if self.stragglers is not None and train_iter is not None:
            train_iter = self.stragglers.data_iterator(train_iter)
        self._announce_final_evaluation(state, valid_iter, test_iter)
        while not self._done(state):
            gbs = self._iteration(state, train_iter, window, result)
            if gbs is None:  # --fault-tolerance: the replica groups dropped it; redo it
                continue
            if self.rt.heartbeat is not None and self.rt.heartbeat.lost:
                raise TrainingError(self.rt.heartbeat.lost)
            if state.iteration % cfg.logging.log_interval == 0:
                self._log(state, gbs, window)
                window = Window()
            if valid_iter is not None and t.eval_iters and state.iteration % t.eval_interval == 0:
                self._settle(window)  # the steps' device time goes to the window, not to eval
                self._validate(state, valid_iter, result, "validation")
            reason = self._exit_reason(state, start_time, window)
            interval = cfg.checkpoint.save_interval
            if reason or (interval and state.iteration % interval == 0) or self._done(state):
                self._settle(window)  # the LR schedule saved takes back the skipped steps
                if reason or self._done(state):
                    self._refuse_a_nonfinite_end(len(result.history))
                self._save(state)
            if reason:
                result.exit_reason = reason
                break
        self._settle(window)  # the steps after the last log line: their history rows get floats
        if result.exit_reason == "finished" and t.eval_iters:
            if valid_iter is not None and state.iteration % t.eval_interval:
                self._validate(state, valid_iter, result, "validation")  # not just done
            if test_iter is not None:
                self._validate(state, test_iter, result, "test")
        result.iteration = state.iteration
        return result

    def _announce_final_evaluation(self, state: TrainState, valid_iter, test_iter) -> None:
        """Megatron's defaults evaluate --eval-iters batches of each split at the end (100 + 100):
        when that outweighs the training left (a short check), say so before it starts."""
        t = self.cfg.training
        splits = [name for name, it in (("validation", valid_iter), ("test", test_iter)) if it]
        left = self._total_iters() - state.iteration
        # a forward-only batch costs about a third of a training step (forward + backward)
        as_steps = len(splits) * t.eval_iters / 3
        if not t.eval_iters or not splits or as_steps <= left:
            return
        self._print(
            f" note: the final evaluation runs {t.eval_iters} batches of the "
            f"{' and the '.join(splits)} split{'s' if len(splits) > 1 else ''} (--eval-iters), "
            f"about the time of {as_steps:.0f} training steps, more than the {left} left to "
            "train; pass a smaller --eval-iters for a short check"
        )

    def _iteration(self, state: TrainState, train_iter, window: Window, result) -> int | None:
        tic = time.perf_counter()
        replicas = getattr(self.backend, "replicas", None)  # --fault-tolerance
        if replicas is not None and replicas.start_step(state):  # the quorum, timed with the step
            train_iter.seek(state.consumed_train_samples)  # a live peer's state and position
        gbs = self.micro.global_batch_at(state.consumed_train_samples)
        self.profiler.before_step(state.iteration)
        self.timers("iteration").start()
        step = self.backend.train_step(
            train_iter, self.micro.num_micro_batches(state.consumed_train_samples), self.timers
        )
        self.announce_commits()  # an --async-save the step's start committed
        self.timers("iteration").stop()
        if step.get("committed") is False:  # the replica groups dropped it: redo, same samples
            train_iter.seek(state.consumed_train_samples)
            return None
        state.iteration += 1
        self.profiler.after_step(state.iteration)
        state.consumed_train_samples += gbs
        row = {
            "iteration": state.iteration,
            # filled in when the window is settled (at the latest at the next log line)
            "lm_loss": None,
            "grad_norm": None,
            "updated": None,
            "lr": self.backend.lr,  # of the next step
            "loss_scale": self.backend.loss_scale,
        }
        if "replicas" in step:  # --fault-tolerance: the replica groups that took part
            row["replicas"] = step["replicas"]
        result.history.append(row)
        window.add(step, time.perf_counter() - tic, row)
        if len(window.pending) >= self.cfg.training.max_skipped_in_a_row:
            self._settle(window)
        return gbs

    def _settle(self, window: Window) -> None:
        """Read the pending steps (one host read): take back the LR schedule of those skipped
        on the device, and stop the run after --max-skipped-in-a-row skips in a row."""
        tic = time.perf_counter()
        settled = window.settle()  # waits for the device: that time is the steps'
        window.seconds += time.perf_counter() - tic
        self._say_scale_warmup(settled.rows)
        if settled.device_skips:
            self.backend.take_back_schedule(settled.device_skips)
            settled.rows[-1]["lr"] = self.backend.lr  # the lr the next step will run with
        limit = self.cfg.training.max_skipped_in_a_row
        for row in settled.rows:
            self.skipped_in_a_row = 0 if row["updated"] else self.skipped_in_a_row + 1
            nonfinite = not row["updated"] and not math.isfinite(row["lm_loss"])
            self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
            if self.skipped_in_a_row >= limit:
                raise TrainingError(
                    f"{self.skipped_in_a_row} iterations in a row were skipped (inf/NaN "
                    f"gradients or loss) up to iteration {row['iteration']}; the run is "
                    "diverging. Lower --lr, check the data, or raise --max-skipped-in-a-row"
                )

    def _refuse_a_nonfinite_end(self, steps: int) -> None:
        """A run must not end 0 while its weights no longer train: its last two steps (or its
        only one) skipped with a non-finite loss end it non-zero, whatever
        --max-skipped-in-a-row says (a short run never reaches it), before the final save."""
        n = self.nonfinite_in_a_row
        if n and n >= min(2, steps):
            raise TrainingError(
                f"the run ends with its last {n} iterations skipped on a non-finite (inf/NaN) "
                "loss: its weights no longer train. Lower --lr, check the float flags and the "
                "data, and resume from the last good checkpoint"
            )

    def _exit_reason(self, state: TrainState, start_time: float, window: Window) -> str | None:
        t = self.cfg.training
        if t.exit_interval and state.iteration % t.exit_interval == 0:
            return "exit-interval"
        if not (t.exit_signal_handler or t.exit_duration_in_mins):
            return None
        over_time = bool(t.exit_duration_in_mins) and (
            time.monotonic() - start_time > 60.0 * t.exit_duration_in_mins
        )
        tic = time.perf_counter()  # the ranks' agreement waits for the step's device work
        signal_any, time_any = _any_rank([self.signal.received, over_time], self.rt.device)
        window.seconds += time.perf_counter() - tic
        if signal_any:
            self._print(f" exiting on SIGTERM at iteration {state.iteration} (saving first)")
            return "signal"
        return "exit-duration" if time_any else None

    def _save(self, state: TrainState) -> None:
        if not self.cfg.checkpoint.save:
            return
        if self.cfg.parallel.ft_replica_id:  # --fault-tolerance: replica group 0 writes them
            return
        self.timers("save-checkpoint", 0).start()
        durable = self.backend.save(state)
        self.timers("save-checkpoint", 0).stop()
        self.announce_commits()  # the previous --async-save, committed before this one
        where = self.cfg.checkpoint.save
        if durable:
            self._print(f" saved checkpoint at iteration {state.iteration} to {where}")
        else:  # "saved" only once the commit makes it durable
            self._print(
                f" staged checkpoint at iteration {state.iteration} in memory (--async-save); "
                f"writing it to {where} in the background"
            )

    def announce_commits(self) -> None:
        """A "saved" line for each --async-save that has committed since the last call."""
        for iteration in self.backend.committed_saves():
            self._print(
                f" saved checkpoint at iteration {iteration} to {self.cfg.checkpoint.save} "
                "(background write committed)"
            )

    def _say_scale_warmup(self, rows: list[dict]) -> None:
        """Once, at the first settled steps: why they were skipped, if fp16 loss scaling did."""
        if not (self.watch_scale_warmup and rows):
            return
        self.watch_scale_warmup = False
        o = self.cfg.optimizer
        line = loss_scale_warmup_line(rows, o.hysteresis, o.initial_loss_scale)
        if line:
            self._print(line)

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
        self.metrics.scalars(
            {f"{split} lm-loss": loss}, state.iteration, state.consumed_train_samples
        )

    def _log(self, state: TrainState, gbs: int, w: Window) -> None:
        self._settle(w)  # before the clock is read: the window's time includes its device work
        replicas = getattr(self.backend, "replicas", None)  # --fault-tolerance
        groups, leads = 1, True
        if replicas is not None:  # the groups that took part; one line for the whole job
            gbs, groups, leads = replicas.log_view(gbs)
        iters = max(w.iters, 1)
        sec = w.seconds / iters
        read = w.summary()
        loss = read["loss"]
        tokens_per_s = gbs * self.cfg.model.seq_length / max(sec, 1e-9)
        devices = self.rt.state.world_size * groups
        tflops = gbs * self.flops_per_sample / max(sec, 1e-9) / devices / 1e12
        mfu = 100.0 * tflops / self.peak if self.peak else None
        grad_norm = read["grad_norm"]
        lr = self.backend.lr
        line = iteration_line(
            iteration=state.iteration,
            train_iters=self._total_iters(),
            consumed=state.consumed_train_samples,
            ms_per_iter=1000.0 * sec,
            lr=lr,
            global_batch=gbs,
            loss=loss,
            loss_scale=self.backend.loss_scale,
            grad_norm=grad_norm,
            skipped=read["skipped"],
            nan=read["nan"],
            tokens_per_s=tokens_per_s,
            tflops=tflops,
            mfu=mfu,
            others=read["others"],
        )
        if leads:  # the other replica groups' loggers stay silent
            self._print(line)
        if self.cfg.logging.timing_log_level > 0:
            self._print(Timers.format(self.timers.pop_elapsed(), iters))
        spread = {}  # --log-straggler: a collective, on every rank
        if self.stragglers is not None:
            lines, spread = self.stragglers.report(state.iteration, iters)
            for line in lines:
                self._print(line)
        self.metrics.scalars(
            {
                "lm-loss": loss,
                "learning-rate": lr,
                "loss-scale": self.backend.loss_scale,
                "tokens-per-second": tokens_per_s,
                "tflops-per-device": tflops,
                "memory-mib": memory_mib(self.rt.device),
                # beside the LM loss: e.g. BERT's NSP loss, MoE's aux loss and expert load
                **{name.replace(" ", "-"): v for name, v in read["others"].items()},
                **spread,
            },
            state.iteration,
            state.consumed_train_samples,
        )

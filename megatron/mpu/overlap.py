"""Two micro batches at once: the forward of one and the backward of another, interleaved at
their expert-parallel all-to-alls so that the tokens of one travel while the other computes
(DualPipeV's overlap, DeepSeek-V3; megatron.training.pipeline runs its pairs through here).

A `PairOverlap` is an object its owner (the pipeline, megatron.training.pipeline) makes and
hands to one model's MoE layers (`given_to(model)`: their `hand_over` slot holds its
`hand_over`, which each passes to the token all-to-all, megatron.mpu.mappings.all_to_all);
nothing here is global, so a model not given one never hands over. `run(forward, backward)`
runs `forward()` in the calling thread and `backward()` in a second one (started once per
process and kept), one of them at a time: the side holding the turn runs until it reaches
`hand_over()`, which the all-to-all (forward and backward) calls between launching its
collective asynchronously and waiting for it; the turn then passes to the other side, which
computes while the first one's all-to-all is in flight. Once a side has finished, the other's
hand-overs return at once and it runs to its end. Outside a pair `hand_over()` does nothing.

Why one side at a time: both issue collectives on the same groups (EP, TP). With strict
alternation at points fixed by the model's code, every rank of a group issues them in the
same order, as NCCL and gloo need; a side with fewer hand-overs (a chunk with fewer MoE
layers) just finishes first. (torchtitan lets both threads run between the two-thread
barriers of its MoE hooks, so it must count the layers and stop coordinating after the
smaller count, and it does not support activation checkpointing.)

State kept per side and swapped at every hand-over:
- the random generators: the CPU default generator, the model's accelerator's (the device
  `run` is given: CUDA or another torch accelerator; none on the CPU), and the named streams
  of the trackers given (megatron.mpu.random). The forward draws its dropout masks as if it
  ran alone. The backward draws none of its own: a recompute (activation checkpointing)
  restores the state its forward saved and afterwards puts back what it found. So the pair
  draws the masks of the sequential order bit for bit, and leaves the generators where the
  forward left them.
- grad mode and autocast are thread-local: the forward keeps the caller's (its thread); the
  backward needs neither (a recompute restores its forward's autocast itself).
- an accelerator: the second thread runs on the caller's device and current stream (so the
  two sides' kernels queue on one stream and the all-to-alls run beside it, on the
  communicator's).
  Autograd runs CUDA backwards in its own device threads: every thread but the caller's is
  the backward's side.
An exception on either side ends the pair: the other side is released (it raises
`PairAborted` at its next hand-over, or before it starts) and the first exception is raised in
the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from megatron.mpu.utils import handed_to

FORWARD, BACKWARD = 0, 1

# Pairs run and hand-overs made since the process started, by every PairOverlap: a statistic
# for tests and benches (nothing reads it to decide anything).
_counts = {"pairs": 0, "hand_overs": 0}


class PairAborted(RuntimeError):
    """Raised on one side of a pair when the other side failed."""


def counts() -> dict[str, int]:
    """Pairs run and hand-overs made in this process so far."""
    return dict(_counts)


def _accelerator(device: torch.device | None):
    """The torch module of `device`'s accelerator (torch.cuda, torch.xpu, ...), or None on
    the CPU: its generator, current device and stream are what a side must share."""
    if device is None or device.type == "cpu":
        return None
    return torch.get_device_module(device)


class _Generators:
    """The random state a side sees: the CPU default generator, the model's accelerator's,
    the trackers' named streams."""

    def __init__(self, trackers: Sequence, device: torch.device | None):
        self.trackers, self.module, self.index = trackers, _accelerator(device), None
        if self.module is not None:  # a device type without an index: the current device
            self.index = device.index if device.index is not None else self.module.current_device()

    def get(self) -> tuple:
        own = None if self.module is None else self.module.get_rng_state(self.index)
        return torch.get_rng_state(), own, [t.get_states() for t in self.trackers]

    def set(self, state: tuple) -> None:
        cpu, own, streams = state
        torch.set_rng_state(cpu)
        if own is not None:
            self.module.set_rng_state(own, self.index)
        for tracker, named in zip(self.trackers, streams, strict=True):
            tracker.set_states(named)


class _Pair:
    def __init__(self, trackers: Sequence, device: torch.device | None):
        self.cond = threading.Condition()
        self.turn, self.finished, self.error = FORWARD, [False, False], None
        self.caller = threading.get_ident()
        self.generators = _Generators(trackers, device)
        start = self.generators.get()
        self.rng = [start, start]  # per side; the backward's start state is never drawn from

    def side(self) -> int:
        return FORWARD if threading.get_ident() == self.caller else BACKWARD

    def hand_over(self) -> None:
        me = self.side()
        with self.cond:
            self._raise_if_failed()
            if self.finished[1 - me]:
                return
            self._pass(me)
            _counts["hand_overs"] += 1
            self._wait_turn(me)

    def _pass(self, me: int) -> None:
        """Give the turn away (under the lock), keeping this side's generators."""
        self.rng[me] = self.generators.get()
        self.turn = 1 - me
        self.cond.notify_all()

    def _wait_turn(self, me: int) -> None:
        self.cond.wait_for(lambda: self.turn == me or self.error is not None)
        self._raise_if_failed()
        self.generators.set(self.rng[me])

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise PairAborted("the other micro batch of the overlapped pair failed")

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def finish(self, me: int) -> None:
        with self.cond:
            self.finished[me] = True
            self._pass(me)

    def run_backward(self, backward: Callable[[], None], stream) -> None:
        """The second thread: wait for the first turn, then run the backward to its end."""
        try:
            with self.cond:
                self._wait_turn(BACKWARD)
            module = self.generators.module
            if stream is not None:  # the caller's device and stream (an accelerator)
                module.set_device(stream.device)
                with module.stream(stream):
                    backward()
            else:
                backward()
        except BaseException as error:  # noqa: BLE001 (handed to the caller, raised there)
            self.fail(error)
        finally:
            self.finish(BACKWARD)


_worker: list = [None, None]  # the second thread and its queue of backwards (kept; no mode)


def _second_thread() -> queue.SimpleQueue:
    """The queue of the thread that runs the pairs' backwards: started once per process (again
    in a forked child) and kept, because a thread of its own per pair costs more than the pair
    (a new thread's first backward sets up autograd's per-thread state: about 100 ms here)."""
    thread, jobs = _worker
    if thread is None or not thread.is_alive():
        jobs = queue.SimpleQueue()
        thread = threading.Thread(target=_serve, args=(jobs,), name="overlap-backward", daemon=True)
        thread.start()
        _worker[:] = [thread, jobs]
    return jobs


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get()()  # run_backward: never raises, hands its error to the pair


class PairOverlap:
    """Overlapped forward / backward pairs of one model, one pair at a time (module doc)."""

    def __init__(self):
        self._pair: _Pair | None = None  # the pair running now

    def given_to(self, model: torch.nn.Module):
        """Inside, the layers of `model` with a `hand_over` slot (the MoE layers) hold this
        object's `hand_over`; afterwards what they held before."""
        return handed_to(model, "hand_over", self.hand_over)

    def hand_over(self) -> None:
        """Pass the turn to the other side of the running pair and wait to get it back; a
        no-op outside a pair or once the other side has finished."""
        pair = self._pair
        if pair is not None:
            pair.hand_over()

    def run(
        self,
        forward: Callable[[], None],
        backward: Callable[[], None],
        trackers: Sequence = (),
        device: torch.device | None = None,
    ) -> None:
        """Run `forward()` here and `backward()` in a second thread, alternating at
        hand_over(); returns when both ended, with the random generators where `forward` left
        them. Raises the first exception of either side. `device`: the model's (None or CPU:
        no accelerator state to share)."""
        if self._pair is not None:
            raise RuntimeError("megatron.mpu.overlap.PairOverlap.run: a pair is already running")
        pair = self._pair = _Pair(trackers, device)
        try:
            _run(pair, forward, backward)
        finally:
            self._pair = None
        pair.generators.set(pair.rng[FORWARD])
        if pair.error is not None:
            raise pair.error


def _run(pair: _Pair, forward: Callable[[], None], backward: Callable[[], None]) -> None:
    module = pair.generators.module
    stream = None if module is None else module.current_stream(pair.generators.index)
    _counts["pairs"] += 1
    try:
        _second_thread().put(lambda: pair.run_backward(backward, stream))
        try:
            forward()
        except BaseException as error:  # noqa: BLE001 (raised by the caller, once both ended)
            pair.fail(error)
        pair.finish(FORWARD)
        with pair.cond:
            pair.cond.wait_for(lambda: pair.finished[BACKWARD])
    finally:
        if not pair.finished[BACKWARD]:  # left early (an interrupt): free the second thread
            pair.fail(PairAborted("the caller left the overlapped pair"))

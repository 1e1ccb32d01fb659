"""The trainer's log says "saved checkpoint" only for a checkpoint that is durable: an
--async-save is logged as staged when its state is copied to memory, as saved when its commit
is done, and a write that fails after staging says that the staged iteration never committed."""

from __future__ import annotations

import errno
import io
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron.checkpoint.async_save import AsyncSaver
from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.training.backend import TrainerBackend
from megatron.training.state import TrainState
from megatron.training.train_loop import TrainLoop
from tests.helpers.training import BASE


class _AsyncBackend(TrainerBackend):
    """Saves the way NativeBackend does with --async-save: stage, write on a thread whose
    outcome `write` decides, commit at a later `poll`."""

    loss_scale = 1.0

    def __init__(self, write):
        self.saver, self.write = AsyncSaver("cpu"), write

    def save(self, state: TrainState) -> bool:
        self.saver.wait()
        self.saver.start(state.iteration, self.write, lambda error: _raise(error))
        return False

    def committed_saves(self) -> list[int]:
        return self.saver.take_committed()

    train_step = evaluate = load = None


def _raise(error):
    if error is not None:
        raise error


def _loop(tmp_path, backend) -> tuple[TrainLoop, io.StringIO]:
    argv = [*BASE, "--train-iters", "8", "--lr", "1e-3", "--global-batch-size", "4"]
    cfg = parse_args([*argv, "--save", str(tmp_path), "--async-save"], world_size=1)
    state = SimpleNamespace(rank=0, world_size=1, dp_size=1, dp_rank=0)
    rt = SimpleNamespace(state=state, device=torch.device("cpu"), heartbeat=None)
    out = io.StringIO()
    return TrainLoop(cfg, rt, backend, out), out


def test_an_async_save_is_logged_staged_then_saved_once_durable(tmp_path):
    release = threading.Event()
    backend = _AsyncBackend(release.wait)
    loop, out = _loop(tmp_path, backend)
    try:
        loop._save(TrainState(iteration=2))
        assert out.getvalue() == (
            " staged checkpoint at iteration 2 in memory (--async-save); writing it to "
            f"{tmp_path} in the background\n"
        )
        assert not backend.saver.poll(lambda mine: mine)  # the writer is still busy
        loop.announce_commits()
        assert "saved" not in out.getvalue()
    finally:
        release.set()  # the writer thread ends whatever failed above
        backend.saver._thread.join()
    assert backend.saver.poll(lambda mine: mine)  # the commit, at the start of a step
    loop.announce_commits()
    assert out.getvalue().splitlines()[-1] == (
        f" saved checkpoint at iteration 2 to {tmp_path} (background write committed)"
    )


def test_a_write_that_fails_after_staging_says_the_staged_save_never_committed(tmp_path):
    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    backend = _AsyncBackend(full_disk)
    loop, out = _loop(tmp_path, backend)
    loop._save(TrainState(iteration=4))
    backend.saver._thread.join()
    with pytest.raises(CheckpointError) as err:
        backend.saver.poll(lambda mine: mine)
    assert "No space left on device" in str(err.value)
    assert "iteration 4 was staged in memory, but its background save did not commit" in str(
        err.value
    )
    loop.announce_commits()
    assert "saved checkpoint" not in out.getvalue()


def test_a_collective_failing_in_the_commit_keeps_its_type_for_the_trainer(tmp_path):
    """A peer gone or a timeout in the commit's collectives stays a RuntimeError, so the trainer
    still explains it as a collective failure (naming the rank); the note says what it cost."""

    def peer_gone():
        raise RuntimeError("Connection closed by peer")

    backend = _AsyncBackend(peer_gone)
    loop, _ = _loop(tmp_path, backend)
    loop._save(TrainState(iteration=6))
    backend.saver._thread.join()
    with pytest.raises(RuntimeError) as err:
        backend.saver.poll(lambda mine: mine)
    assert not isinstance(err.value, CheckpointError)
    assert "iteration 6 was staged in memory" in " ".join(getattr(err.value, "__notes__", []))

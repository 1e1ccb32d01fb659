"""--async-save keeps the promises of a synchronous save: a SIGKILL at any point of a
background write leaves the pointer on a complete checkpoint that loads; a failed write stops
the run at the next step with the named error on every rank; SIGTERM and the end of training
wait for the writer and commit. (Async checkpoints load to the sync run's state:
test_reshard_on_load.)"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import megatron.checkpoint.storage as storage
from megatron.checkpoint.async_save import AsyncSaver
from megatron.checkpoint.reading import load_shard, read_tracker, resolve_load_iteration
from megatron.checkpoint.storage import MARKER_NAME, CheckpointError, checkpoint_dir
from megatron.models.gpt.train import forward_step as _forward_step
from tests.helpers.checkpoints import full_disk_on_rank1
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.training import _CALLS, _sigterm_on_rank1_iteration3, _train, flags

# A one-rank --async-save run saving at 2 and 4 that kills itself during the save of 4.
_CHILD = """
import os, signal, sys, threading
import megatron.checkpoint.storage as storage
from tests.helpers.training import _train

root, point, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
at4 = os.path.join(root, "iter_0000004")

def die():
    os.kill(os.getpid(), signal.SIGKILL)

real_replace, real_fsync = os.replace, os.fsync
def replace(src, dst):
    dst = os.fspath(dst)
    writer = threading.current_thread() is not threading.main_thread()
    if point == "shard_rename" and writer and dst.startswith(at4):
        die()  # the background writer, its shard written and fsynced, not yet renamed
    if point == "marker" and dst == os.path.join(at4, storage.MARKER_NAME):
        die()  # the commit on the training thread, every shard in place
    if point == "pointer" and dst == storage.tracker_path(root) and os.path.isdir(at4):
        die()
    real_replace(src, dst)

def fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if point == "mid_write" and path.startswith(at4) and ".tmp." in path:
        die()  # the background writer, its temp file written but not yet durable
    real_fsync(fd)

os.replace, os.fsync = replace, fsync
_train(0, 1, [*argv, "--save", root, "--save-interval", "2", "--async-save"])
"""
KILL_POINTS = ["mid_write", "shard_rename", "marker", "pointer"]


@pytest.mark.slow
def test_sigkill_during_a_background_write_leaves_the_pointer_on_a_complete_checkpoint(
    data_prefix,
    tmp_path,
):
    argv = flags(data_prefix, iters=6)
    children = {}
    for point in KILL_POINTS:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        children[point] = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path / point), point, *argv],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    for point, child in children.items():
        out = child.communicate(timeout=300)[0].decode()
        assert child.returncode == -signal.SIGKILL, f"{point}: exit {child.returncode}\n{out}"
        root = tmp_path / point
        assert read_tracker(root) == 2, point
        assert resolve_load_iteration(root) == 2, point
        shard = load_shard(root, 2, tp_rank=0, pp_rank=0, pp_size=1)  # checksum verified
        assert shard["iteration"] == 2 and "optimizer" in shard, point
        marked = os.path.exists(os.path.join(checkpoint_dir(root, 4), MARKER_NAME))
        assert marked == (point == "pointer"), point  # killed before or after its marker


def _failing_and_sigterm_worker(rank, world, argv, full_root, sigterm_root):
    """At TP=2, rank 1's background write of iteration 4 finds the disk full: (the error each
    rank raised, forward calls made by then). Then at DP=2, a SIGTERM on rank 1 during
    iteration 3: (exit reason, iteration)."""
    calls = {"n": 0}

    def counting(data_iterator, model):
        calls["n"] += 1
        return _forward_step(data_iterator, model)

    storage.open = full_disk_on_rank1(rank)
    try:
        tp2 = [*argv, "--tensor-model-parallel-size", "2", "--save", full_root]
        _train(rank, world, [*tp2, "--save-interval", "2", "--async-save"], counting)
        failed = None
    except CheckpointError as e:
        failed = str(e)
    finally:
        del storage.open
    _CALLS["n"] = 0
    sigterm = [*argv, "--exit-signal-handler", "--save", sigterm_root, "--async-save"]
    _, reason, iteration = _train(rank, world, sigterm, _sigterm_on_rank1_iteration3)
    return failed, calls["n"], reason, iteration


@pytest.mark.slow
def test_failed_background_write_stops_the_run_at_the_next_step_and_sigterm_waits(
    data_prefix,
    tmp_path,
):
    argv = flags(data_prefix, iters=10)
    full, term = str(tmp_path / "full"), str(tmp_path / "term")
    results = run_distributed(_failing_and_sigterm_worker, 2, argv, full, term)
    lost = storage.shard_path(full, 4, 1, 0, 1)
    (msg0, calls0, reason0, it0), (msg1, calls1, reason1, it1) = results
    assert msg1.startswith(f"cannot write checkpoint file {lost}: [Errno {errno.ENOSPC}]"), msg1
    assert msg0.startswith("iteration 4 was not saved: rank 1 failed (cannot write"), msg0
    # TP=2 x DP=1, 4 micro batches a step: both ranks stopped together at the first step
    # that began after the writers were done (step 5 or a later one), at the latest at the
    # next save (6), which waits for the writer; never at the end of the run (10).
    assert calls0 == calls1 and calls0 in (4 * 4, 5 * 4, 6 * 4), results
    assert read_tracker(full) == 2 and resolve_load_iteration(full) == 2
    assert (reason0, it0) == (reason1, it1) == ("signal", 3)
    assert read_tracker(term) == 3  # the SIGTERM save was committed before the run returned
    assert load_shard(term, 3, tp_rank=0, pp_rank=0, pp_size=1)["iteration"] == 3


def test_at_most_one_save_in_flight_and_the_error_reaches_the_commit():
    saver = AsyncSaver("cpu")
    staged = saver.stage({"w": (w := torch.ones(3)), "it": 1, "r": (0, 3)})
    w.add_(1)  # training goes on: the staged copy does not move
    assert torch.equal(staged["w"], torch.ones(3)) and staged["r"] == (0, 3)
    release, committed = threading.Event(), []
    saver.start(1, release.wait, committed.append)
    with pytest.raises(RuntimeError, match="already in flight"):
        saver.start(2, lambda: None, committed.append)
    assert not saver.poll(lambda mine: mine) and saver.pending  # the writer is still busy
    release.set()
    saver.wait()
    assert committed == [None] and not saver.pending

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    saver.start(3, fail, committed.append)
    saver._thread.join()
    assert saver.poll(lambda mine: mine)
    assert isinstance(committed[-1], OSError) and not saver.pending

"""Elastic restarts (RELIABILITY: a restart resumes exactly): under `torchrun --max-restarts 1`
a rank killed mid-run is restarted with the others, the run resumes from the last complete
checkpoint in the same --save/--load directory, and ends with the uninterrupted run's losses;
a job stopped by SIGTERM and launched again does the same. (The ranks' stopping itself:
test_elastic_stop.py.)"""

import re
import signal
import subprocess

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.torchrun import ENV, command, losses, torchrun
from tests.helpers.training import flags

PRETRAIN = str(ROOT / "pretrain_gpt2.py")


def _argv(data_prefix):
    """20 iterations on 2 gloo ranks (the learning rate decays over the 20)."""
    argv = flags(data_prefix, "--distributed-backend", "gloo", iters=20)
    argv[argv.index("--lr-decay-iters") + 1] = "20"
    return argv


@pytest.fixture(scope="module")
def straight(data_prefix, tmp_path_factory):
    """The uninterrupted run's losses by iteration: both tests' reference (one launch for both;
    --save-interval and --exit-signal-handler, which they add, do not change the losses)."""
    tmp = tmp_path_factory.mktemp("straight")
    run, want = torchrun([PRETRAIN, *_argv(data_prefix), "--save", str(tmp / "a")], tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(want) == list(range(1, 21))
    return want


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_rank_resumes_with_the_same_losses(
    data_prefix,
    straight,
    tmp_path,
):
    argv = [*_argv(data_prefix), "--save-interval", "4"]
    ckpt = str(tmp_path / "b")
    worker = str(ROOT / "tests" / "helpers" / "elastic_worker.py")
    restarted, got = torchrun([worker, "7", *argv, "--save", ckpt, "--load", ckpt], tmp_path)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "exitcode: -9" in restarted.stderr  # the kill happened and torchrun restarted
    log = restarted.stdout + restarted.stderr
    assert re.search(r"loaded checkpoint from .* at iteration 4\n", log), log[-3000:]
    assert got == straight  # bit-identical losses as logged, iterations 1-20


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_requeued_job_resumes_exactly(
    data_prefix,
    straight,
    tmp_path,
):
    """A scheduler's SIGTERM goes to torchrun, which passes it to every rank: with
    --exit-signal-handler they save at the next iteration boundary and stop; launching the
    same command again (a requeue) continues with the uninterrupted run's losses."""
    argv = [*_argv(data_prefix), "--exit-signal-handler"]
    ckpt = ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]
    first = subprocess.Popen(
        command([PRETRAIN, *argv, *ckpt], 0),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in first.stdout:
        seen.append(line)
        if " iteration        5/" in line:
            first.send_signal(signal.SIGTERM)
            break
    out, err = first.communicate(timeout=120)
    saved = int((tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text())
    assert 5 <= saved < 20, err[-3000:]
    requeued, got = torchrun([PRETRAIN, *argv, *ckpt], tmp_path, max_restarts=0)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    got = {**losses("".join(seen) + out), **got}
    assert got == straight

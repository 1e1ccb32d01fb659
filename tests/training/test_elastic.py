"""Elastic restarts (RELIABILITY: a restart resumes exactly): under `torchrun --max-restarts 1`
a rank killed mid-run is restarted with the others, the run resumes from the last complete
checkpoint in the same --save/--load directory, and ends with the uninterrupted run's losses."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT
from tests.helpers.training import flags

_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ .*\| lm loss: ([0-9.E+-]+) \|")


def _command(script_args, max_restarts=1):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(max_restarts),
        "--master_port",
        str(free_port()),
        *script_args,
    ]


_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _losses(stdout: str) -> dict[int, str]:
    losses = {}
    for line in stdout.splitlines():  # a resumed attempt logs its iterations again
        if m := _LOSS.search(line):
            losses[int(m[1])] = m[2]
    return losses


def _torchrun(script_args, cwd, max_restarts=1):
    cmd = _command(script_args, max_restarts)
    run = subprocess.run(cmd, cwd=cwd, env=_ENV, capture_output=True, text=True, timeout=240)
    return run, _losses(run.stdout)


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_rank_resumes_with_the_same_losses(
    data_prefix,
    tmp_path,
):
    common = ["--distributed-backend", "gloo", "--save-interval", "4"]
    argv = flags(data_prefix, *common, iters=10)
    straight, want = _torchrun(
        [str(ROOT / "pretrain_gpt2.py"), *argv, "--save", str(tmp_path / "a")], tmp_path
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = str(tmp_path / "b")
    restarted, got = _torchrun(
        [
            str(ROOT / "tests" / "helpers" / "elastic_worker.py"),
            "7",
            *argv,
            "--save",
            ckpt,
            "--load",
            ckpt,
        ],
        tmp_path,
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "exitcode: -9" in restarted.stderr  # the kill happened and torchrun restarted
    log = restarted.stdout + restarted.stderr
    assert re.search(r"loaded checkpoint from .* at iteration 4\n", log), log[-3000:]
    assert sorted(got) == list(range(1, 11))
    assert got == want  # bit-identical losses as logged, iterations 1-10


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_the_requeued_job_resumes_exactly(
    data_prefix,
    tmp_path,
):
    """A scheduler's SIGTERM goes to torchrun, which passes it to every rank: with
    --exit-signal-handler they save at the next iteration boundary and stop; launching the
    same command again (a requeue) continues with the uninterrupted run's losses."""
    argv = flags(data_prefix, "--distributed-backend", "gloo", "--exit-signal-handler", iters=40)
    argv[argv.index("--lr-decay-iters") + 1] = "40"
    pretrain = str(ROOT / "pretrain_gpt2.py")
    straight, want = _torchrun([pretrain, *argv, "--save", str(tmp_path / "a")], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")]
    first = subprocess.Popen(
        _command([pretrain, *argv, *ckpt], 0),
        cwd=tmp_path,
        env=_ENV,
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
    assert 5 <= saved < 40, err[-3000:]
    requeued, got = _torchrun([pretrain, *argv, *ckpt], tmp_path, max_restarts=0)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    got = {**_losses("".join(seen) + out), **got}
    assert sorted(got) == list(range(1, 41)) and got == want

"""Elastic restarts (RELIABILITY: a restart resumes exactly): under `torchrun --max-restarts 1`
a rank killed mid-run is restarted with the others, the run resumes from the last complete
checkpoint in the same --save/--load directory, and ends with the uninterrupted run's losses."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    argv = flags(data_prefix, "--distributed-backend", "gloo", "--exit-signal-handler", iters=20)
    argv[argv.index("--lr-decay-iters") + 1] = "20"
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
    assert 5 <= saved < 20, err[-3000:]
    requeued, got = _torchrun([pretrain, *argv, *ckpt], tmp_path, max_restarts=0)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    got = {**_losses("".join(seen) + out), **got}
    assert sorted(got) == list(range(1, 21)) and got == want


def _default_workers(argv):
    """The flags without the tests' --num-workers 0: a user's run has the default 2 workers."""
    i = argv.index("--num-workers")
    return argv[:i] + argv[i + 2 :]


def _ranks_of(launcher_pid: int) -> list[int]:
    """The pids whose parent is the launcher (Linux /proc)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == launcher_pid:
            out.append(int(d))
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_with_default_loader_workers_lands_in_saves_and_still_saves(
    data_prefix,
    tmp_path,
):
    """torchrun sends SIGTERM to each rank's whole process group, loader workers included. A
    worker killed by it made its rank raise "DataLoader worker ... is killed by signal" (even
    inside torch.save): no checkpoint, torchrun SIGKILLed the other rank 30 s later. Saving
    every iteration puts the signal in or near a save."""
    argv = flags(data_prefix, "--distributed-backend", "gloo", "--exit-signal-handler", iters=200)
    argv = [*_default_workers(argv), "--save-interval", "1", "--save", str(tmp_path / "ck")]
    run = subprocess.Popen(
        _command([str(ROOT / "pretrain_gpt2.py"), *argv], 0),
        cwd=tmp_path,
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in run.stdout:
        if " iteration        5/" in line:
            run.send_signal(signal.SIGTERM)
            break
    out, err = run.communicate(timeout=120)
    rank_errors = [x for x in err.splitlines() if x.startswith("[rank") and "Error" in x]
    assert not rank_errors and "killed by signal" not in err, err[-3000:]
    saved = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert f" exiting on SIGTERM at iteration {saved} (saving first)" in out, err[-3000:]
    assert f" saved checkpoint at iteration {saved} " in out
    # The ranks stopped by themselves within torchrun's 30 s grace: it passed SIGTERM on and
    # did not have to SIGKILL a rank, which it logs. What happened, not a wall-time bound (a
    # loaded machine took 20 s).
    assert "closing signal SIGTERM" in err, err[-3000:]
    assert "Unable to shutdown process" not in err, err[-3000:]


@pytest.mark.slow
def test_ranks_stop_with_a_named_error_when_the_launcher_is_killed(
    data_prefix,
    tmp_path,
):
    """SIGKILL of torchrun's agent (a scheduler's hard kill) left the ranks, in their own
    session, training to the end; they now notice the lost store within seconds and stop."""
    argv = flags(data_prefix, "--distributed-backend", "gloo", iters=5000)
    argv[argv.index("--lr-decay-iters") + 1] = "5000"
    launcher = subprocess.Popen(
        _command([str(ROOT / "pretrain_gpt2.py"), *_default_workers(argv)], 0),
        cwd=tmp_path,
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "stderr.txt", "w"),
        text=True,
    )
    for line in launcher.stdout:
        if " iteration        3/" in line:
            break
    ranks = _ranks_of(launcher.pid)
    assert len(ranks) == 2
    threading.Thread(target=launcher.stdout.read, daemon=True).start()  # the ranks write on
    killed = time.monotonic()
    launcher.kill()
    launcher.wait()
    while any(map(_running, ranks)) and time.monotonic() - killed < 40:
        time.sleep(0.2)
    stop_s = time.monotonic() - killed
    for pid in filter(_running, ranks):
        os.kill(pid, signal.SIGKILL)
    assert stop_s < 25, f"ranks still training {stop_s:.0f} s after the launcher was killed"
    err = (tmp_path / "stderr.txt").read_text()
    assert "lost the job: the launcher's c10d store (torchrun's agent) is gone" in err

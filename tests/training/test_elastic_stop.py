"""A stopped job's ranks stop: SIGTERM (with the loader's worker processes) lands in a save and
the ranks exit by themselves; SIGKILL of torchrun's agent ends the ranks with a named error."""

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.torchrun import ENV, command, default_workers, ranks_of, running
from tests.helpers.training import flags


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
    argv = [*default_workers(argv), "--save-interval", "1", "--save", str(tmp_path / "ck")]
    run = subprocess.Popen(
        command([str(ROOT / "pretrain_gpt2.py"), *argv], 0),
        cwd=tmp_path,
        env=ENV,
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
@pytest.mark.parametrize("nproc", [2, 1])
def test_ranks_stop_with_a_named_error_when_the_launcher_is_killed(data_prefix, tmp_path, nproc):
    """SIGKILL of torchrun's agent (a scheduler's hard kill) left the ranks, in their own
    session, training to the end; they now notice the lost store within seconds and stop. A
    1-rank job's rank did not watch the store (every --fault-tolerance replica group is one)."""
    argv = flags(data_prefix, "--distributed-backend", "gloo", iters=5000)
    argv[argv.index("--lr-decay-iters") + 1] = "5000"
    launcher = subprocess.Popen(
        command([str(ROOT / "pretrain_gpt2.py"), *default_workers(argv)], 0, nproc),
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "stderr.txt", "w"),
        text=True,
    )
    for line in launcher.stdout:
        if " iteration        3/" in line:
            break
    ranks = ranks_of(launcher.pid)
    assert len(ranks) == nproc
    threading.Thread(target=launcher.stdout.read, daemon=True).start()  # the ranks write on
    killed = time.monotonic()
    launcher.kill()
    launcher.wait()
    while any(map(running, ranks)) and time.monotonic() - killed < 40:
        time.sleep(0.2)
    stop_s = time.monotonic() - killed
    for pid in filter(running, ranks):
        os.kill(pid, signal.SIGKILL)
    assert stop_s < 25, f"ranks still training {stop_s:.0f} s after the launcher was killed"
    err = (tmp_path / "stderr.txt").read_text()
    assert "lost the job: the launcher's c10d store (torchrun's agent) is gone" in err

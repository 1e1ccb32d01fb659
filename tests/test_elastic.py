"""Elastic restarts (RELIABILITY: a restart resumes exactly): under `torchrun --max-restarts 1`
a rank killed mid-run is restarted with the others, the run resumes from the last complete
checkpoint in the same --save/--load directory, and ends with the uninterrupted run's losses."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.test_training import data_prefix, flags  # noqa: F401  (fixture)

ROOT = Path(__file__).parent.parent
_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ .*\| lm loss: ([0-9.E+-]+) \|")


def _torchrun(script_args, cwd, max_restarts=1):
    cmd = [
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    losses = {}
    for line in run.stdout.splitlines():  # a resumed attempt logs its iterations again
        if m := _LOSS.search(line):
            losses[int(m[1])] = m[2]
    return run, losses


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_rank_resumes_with_the_same_losses(
    data_prefix,  # noqa: F811
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
        [str(ROOT / "tests" / "elastic_worker.py"), "7", *argv, "--save", ckpt, "--load", ckpt],
        tmp_path,
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "exitcode: -9" in restarted.stderr  # the kill happened and torchrun restarted
    log = restarted.stdout + restarted.stderr
    assert re.search(r"loaded checkpoint from .* at iteration 4\n", log), log[-3000:]
    assert sorted(got) == list(range(1, 11))
    assert got == want  # bit-identical losses as logged, iterations 1-10

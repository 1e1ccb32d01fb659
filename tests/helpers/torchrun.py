"""torchrun launches of pretrain_gpt2.py for the elastic tests (tests/training/test_elastic.py,
test_elastic_stop.py): the command, its environment, the losses it logged, and the ranks."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT

_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ .*\| lm loss: ([0-9.E+-]+) \|")


def command(script_args, max_restarts=1, nproc=2):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--master_port",
        str(free_port()),
        *script_args,
    ]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def losses(stdout: str) -> dict[int, str]:
    found = {}
    for line in stdout.splitlines():  # a resumed attempt logs its iterations again
        if m := _LOSS.search(line):
            found[int(m[1])] = m[2]
    return found


def torchrun(script_args, cwd, max_restarts=1):
    cmd = command(script_args, max_restarts)
    run = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=240)
    return run, losses(run.stdout)


def default_workers(argv):
    """The flags without the tests' --num-workers 0: a user's run has the default 2 workers."""
    i = argv.index("--num-workers")
    return argv[:i] + argv[i + 2 :]


def ranks_of(launcher_pid: int) -> list[int]:
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


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

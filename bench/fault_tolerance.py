"""A rank SIGKILLed mid-run: --fault-tolerance (torchft replica groups) against today's
`torchrun --max-restarts 1` restart from the last checkpoint, on CPU gloo ranks.

    .venv/bin/python bench/fault_tolerance.py [--ranks 4] [--iters 60] [--kill-at 20]
        [--save-interval 10]

Both runs train the tests' tiny GPT (2 layers, hidden 32) with data parallelism over --ranks
processes (torchft: --ranks replica groups of one rank; torchrun: DP --ranks), and rank /
group 1 kills itself with SIGKILL in the forward of iteration --kill-at. Columns:
  stall s         the gap in the surviving log (group 0 / the restarted job) between the last
                  iteration logged before the kill and the first one after it, less one median
                  step: the time the job did not train
  lost s          from that last iteration before the kill until the killed iteration is
                  logged, less one step: the stall plus the time to redo the lost steps
  steps redone    iterations trained twice (torchrun: since the last checkpoint; torchft: the
                  step the kill interrupted, redone by the survivors)
  full DP after s torchft: from the kill until a replacement group, started by this script
                  at the kill, takes part in a step (start-up + recovery from a live peer);
                  torchrun: the time lost (every rank restarts)
  step ms         the median ms/iteration before the kill (steady state)
  of which ft ms  torchft's own protocol per step, as group 0 measured it: the lighthouse
                  quorum and the commit vote (median over the run; its second small
                  all-reduce is not included)
Timestamps are those at which this script reads each log line (a pipe; milliseconds late at
most). Tiny steps make the per-step cost of torchft look large: it is a fixed few ms.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.distributed import free_port  # noqa: E402
from tests.helpers.training import counting_corpus, flags  # noqa: E402

_ITER = re.compile(r" iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([0-9.]+)")
_PROTOCOL = re.compile(r"quorum \+ commit vote per step: median ([0-9.]+) ms")
_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


class _Log:
    """A process's stdout lines, each with the time it was read."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def iterations(self):
        return [(t, int(m[1]), float(m[2])) for t, line in self.lines if (m := _ITER.search(line))]

    def first(self, text: str, after: float = 0.0):
        return next((t for t, line in self.lines if t > after and text in line), None)


def _start(cmd, env=None):
    p = subprocess.Popen(
        cmd,
        env={**_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    return p, _Log(p)


def _stall(log: _Log, kill_at: int, step_s: float) -> tuple[float, float]:
    """(seconds without training, seconds lost) around the kill: from the line of iteration
    kill_at - 1 to the next line (the restarted job logs from its checkpoint on), and to the
    line of iteration kill_at, each less one normal step."""
    its = log.iterations()
    before = min(t for t, i, _ in its if i == kill_at - 1)  # a restarted job logs it again
    after = min(t for t, i, _ in its if t > before and i != kill_at - 1)
    past = min(t for t, i, _ in its if i == kill_at)
    return after - before - step_s, past - before - step_s


def bench_torchft(args, argv) -> dict:
    from torchft.coordination import LighthouseServer

    light = LighthouseServer(
        bind="[::]:0", min_replicas=args.ranks // 2 + 1, join_timeout_ms=5000, quorum_tick_ms=20,
        heartbeat_timeout_ms=1000,
    )  # fmt: skip
    ft = ["--fault-tolerance", "--ft-group-size", str(args.ranks), "--ft-timeout-seconds", "5"]
    ft += ["--ft-lighthouse", light.address()]
    worker = str(ROOT / "tests" / "helpers" / "ft_worker.py")
    tmp = Path(args.dir)
    booted = tmp / "booted"
    hold = ["--hold-at", str(args.iters - 2), "--hold-for", str(booted)]

    def group(r, *extra):
        cmd = [sys.executable, worker, str(tmp / f"ft{r}{len(extra)}.pt"), *extra, "--"]
        port = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        return _start([*cmd, *argv, *ft, "--ft-replica-id", str(r)], port)

    groups = [
        group(r, *(["--kill-at", str(args.kill_at)] if r == 1 else hold)) for r in range(args.ranks)
    ]
    groups[1][0].wait()
    killed = time.monotonic()
    replacement = group(1, "--booted", str(booted))
    for p, _ in [*groups, replacement]:
        p.wait()
    light.shutdown()
    log = groups[0][1]
    step_s = statistics.median(ms for _, i, ms in log.iterations() if 1 < i < args.kill_at) / 1e3
    full = log.first(f"take part ({args.ranks} of {args.ranks})", after=killed)
    redone = sum("not committed" in line for t, line in log.lines if t > killed)
    protocol = next(m[1] for _, line in log.lines if (m := _PROTOCOL.search(line)))
    stall, lost = _stall(log, args.kill_at, step_s)
    return {
        "stall": stall,
        "lost": lost,
        "redone": redone,
        "full": None if full is None else full - killed,
        "step_ms": 1e3 * step_s,
        "protocol_ms": float(protocol),
    }


def bench_torchrun(args, argv) -> dict:
    ckpt = str(Path(args.dir) / "ckpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks)]
    cmd += ["--max-restarts", "1", "--master_port", str(free_port())]
    cmd += [str(ROOT / "tests" / "helpers" / "elastic_worker.py"), str(args.kill_at), *argv]
    cmd += ["--save-interval", str(args.save_interval), "--save", ckpt, "--load", ckpt]
    p, log = _start(cmd)
    p.wait()
    step_s = statistics.median(ms for _, i, ms in log.iterations() if 1 < i < args.kill_at) / 1e3
    stall, lost = _stall(log, args.kill_at, step_s)
    last_save = (args.kill_at - 1) // args.save_interval * args.save_interval
    return {
        "lost": lost,
        "stall": stall,
        "redone": args.kill_at - 1 - last_save,
        "full": lost,
        "step_ms": 1e3 * step_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20)
    p.add_argument("--save-interval", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        args.dir = d
        argv = flags(counting_corpus(d), "--distributed-backend", "gloo", iters=args.iters)
        argv[argv.index("--lr-decay-iters") + 1] = str(2 * args.iters)
        rows = {"torchft": bench_torchft(args, argv), "torchrun": bench_torchrun(args, argv)}
    print(f"{args.ranks} ranks, kill at iteration {args.kill_at} of {args.iters}, "
          f"torchrun --save-interval {args.save_interval}")  # fmt: skip
    print("| path | stall s | lost s | steps redone | full DP after s | step ms | of which ft ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    names = {"torchft": "--fault-tolerance (torchft)", "torchrun": "torchrun --max-restarts 1"}
    for key, r in rows.items():
        full = "never" if r["full"] is None else f"{r['full']:.1f}"
        print(
            f"| {names[key]} | {r['stall']:.1f} | {r['lost']:.1f} | {r['redone']} | {full} "
            f"| {r['step_ms']:.0f} | {r.get('protocol_ms', 0):.1f} |"
        )


if __name__ == "__main__":
    main()

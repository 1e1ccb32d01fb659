"""Overhead of --log-straggler with no straggler: step time without and with it, side by side.

    .venv/bin/python bench/straggler.py [--ranks 2 --iters 40 --repeats 2 --log-interval 10]

1. End to end: a tiny GPT on gloo ranks (DP = --ranks), trained --iters steps without and with
   --log-straggler, --repeats times each in one spawn (alternating which goes first); the time
   per iteration is the logging rank's wall time from its first log line to its last (steps,
   log lines and reports included), median over the runs. On a busy machine the noise between
   runs is larger than the detector's cost, hence part 2.
2. The detector's own cost, measured on the same ranks: one timer start/stop pair with and
   without the section wrapper (the extra per timed phase: forward and backward per micro
   batch, the gradient reduction, the optimizer), one next() through the data wrapper (one
   per micro batch), and one report() (the all-gather of a few floats and the report lines,
   once per log line). Their sum per step, as a share of the step time of part 1.
"""

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.rules import validate  # noqa: E402
from megatron.resilience.straggler import straggler_detector  # noqa: E402
from megatron.training.loop import pretrain  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402
from tests.helpers.distributed import free_port, run_distributed  # noqa: E402
from tests.helpers.training import counting_corpus, flags  # noqa: E402


class _Stamped(io.StringIO):
    """The log, with the time each iteration line was written."""

    def __init__(self):
        super().__init__()
        self.stamps = []

    def write(self, text):
        if "elapsed time per iteration" in text:
            self.stamps.append(time.perf_counter())
        return super().write(text)


def _run(argv, world, log_interval) -> float:
    """Wall ms per iteration from the first log line to the last: the steps, the log lines
    and (with --log-straggler) the report, all included."""
    cfg = validate(parse_args(argv, world_size=world), "train-gpt")
    out = _Stamped()
    pretrain(cfg, out=out)
    if len(out.stamps) < 2:  # not the logging rank
        return float("nan")
    steps = log_interval * (len(out.stamps) - 1)
    return 1000.0 * (out.stamps[-1] - out.stamps[0]) / steps


def _us(fn, n: int) -> float:
    """Median over 5 batches of fn(n)'s time per call, microseconds (a busy machine's
    preemptions land in a few batches, not in the median)."""
    samples = []
    for _ in range(5):
        tic = time.perf_counter()
        fn(n)
        samples.append(1e6 * (time.perf_counter() - tic) / n)
    return statistics.median(samples)


def _timer_pairs(timers):
    def run(n):
        for _ in range(n):
            timers("forward-compute", 1).start()
            timers("forward-compute", 1).stop()

    return run


def _components(port) -> dict[str, float]:
    """Microseconds: a timer pair without and with the wrapper, a next() through the timed
    iterator minus a plain one, one report() (a collective: every rank runs this)."""
    lg = SimpleNamespace(
        log_straggler=True,
        straggler_minmax_count=1,
        straggler_ctrlr_port=port,
        disable_straggler_on_startup=False,
    )
    state = SimpleNamespace(rank=dist.get_rank(), pp_rank=0)
    det = straggler_detector(
        lg, SimpleNamespace(state=state, device=torch.device("cpu")), io.StringIO()
    )
    plain, wrapped = Timers(0), Timers(0)
    wrapped.sections = det
    out = {"timer pair": _us(_timer_pairs(plain), 4000)}
    out["timer pair, wrapped"] = _us(_timer_pairs(wrapped), 4000)

    def read(n, wrap):
        for _ in wrap(iter(range(n))):
            pass

    plain_next = _us(lambda n: read(n, lambda it: it), 4000)
    out["next() extra"] = _us(lambda n: read(n, det.data_iterator), 4000) - plain_next
    dist.barrier()  # the ranks enter the all-gathers together: their skew is not the cost
    out["report()"] = _us(lambda n: [det.report(i, 10) for i in range(n)], 10)
    det.close()
    return out


def _worker(rank, world, argv, repeats, log_interval, port):
    times = {"without": [], "with": []}
    runs = {
        "without": argv,
        "with": argv + ["--log-straggler", "--straggler-ctrlr-port", str(port)],
    }
    for i in range(repeats):  # alternating which goes first: the second run of a pair is faster
        for kind in ("without", "with") if i % 2 == 0 else ("with", "without"):
            times[kind].append(_run(runs[kind], world, log_interval))
    return times, _components(port)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        argv = flags(counting_corpus(d, documents=400), iters=a.iters)
        argv += ["--log-interval", str(a.log_interval), "--eval-iters", "0"]
        results = run_distributed(
            _worker, a.ranks, argv, a.repeats, a.log_interval, free_port(), timeout=600
        )
    times, parts = results[-1]  # the logging rank
    micro = 8 // (2 * a.ranks)  # flags(): global batch 8, micro batch 2
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    print(
        f"{a.ranks} gloo ranks, tiny GPT, {micro} micro batch(es) per step, "
        f"log interval {a.log_interval}, {a.iters} iterations, {a.repeats} runs each"
    )
    print(f"{'':34} {'without':>10} {'with':>10} {'change':>8}")
    print(
        f"{'ms per iteration (median)':34} {without:10.2f} {with_:10.2f} "
        f"{100 * (with_ / without - 1):7.2f}%"
    )
    extra_us = (2 * micro + 2) * (parts["timer pair, wrapped"] - parts["timer pair"])
    extra_us += micro * parts["next() extra"] + parts["report()"] / a.log_interval
    print(
        f"{'timer start+stop (us)':34} {parts['timer pair']:10.2f} "
        f"{parts['timer pair, wrapped']:10.2f}"
    )
    print(f"{'next() through the data wrapper (us)':34} {'':10} {parts['next() extra']:10.2f}")
    print(f"{'report() per log line (us)':34} {'':10} {parts['report()']:10.1f}")
    print(
        f"{'detector cost per step (us)':34} {'':10} {extra_us:10.1f} "
        f"{100 * extra_us / 1000 / without:7.3f}%"
    )


if __name__ == "__main__":
    main()

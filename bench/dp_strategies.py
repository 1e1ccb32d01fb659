"""Step time of each data-parallel memory strategy on gloo CPU ranks, a tiny GPT, side by side.

    .venv/bin/python bench/dp_strategies.py [--dp 2 --layers 4 --hidden 128 --steps 8 --rounds 3]

Each strategy trains the same GPT on the same toy corpus through pretrain() (the trainer's own
path: flags, backend, step), in turn, in one spawn of DP ranks: plain data parallelism,
--use-distributed-optimizer (ZeRO-1), --use-torch-fsdp2 (its default auto, and with and without
resharding after forward: ZeRO-3 / ZeRO-2-like), and DeepSpeed's ZeRO 1, 2 and 3 (when
installed), after one warm-up run (a process's first run is slower). A step's time is the time
between the first micro batches of two steps (the forward step is wrapped to stamp it); each
round takes the median over the steps after the first two, and the fastest of `--rounds`
rounds (all strategies in each) is printed, the least disturbed by other jobs. CPU and gloo
say what the communication pattern costs relative to the others on this machine, not what a
GPU cluster would see.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.models.gpt.train import forward_step  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.training import counting_corpus, flags, train_run  # noqa: E402

STRATEGIES = {
    "plain DDP": [],
    "distributed optimizer (ZeRO-1)": ["--use-distributed-optimizer"],
    "FSDP2 (default: --torch-fsdp2-reshard-after-forward auto)": ["--use-torch-fsdp2"],
    "FSDP2 (reshard after forward)": [
        "--use-torch-fsdp2",
        "--torch-fsdp2-reshard-after-forward",
        "true",
    ],
    "FSDP2 --torch-fsdp2-no-reshard-after-forward": [
        "--use-torch-fsdp2",
        "--torch-fsdp2-no-reshard-after-forward",
    ],
    "DeepSpeed ZeRO-1": ["--deepspeed", "--zero-stage", "1"],
    "DeepSpeed ZeRO-2": ["--deepspeed", "--zero-stage", "2"],
    "DeepSpeed ZeRO-3": ["--deepspeed", "--zero-stage", "3"],
}


def _stamping(stamps: list):
    def step(data_iterator, model):
        stamps.append(time.perf_counter())
        return forward_step(data_iterator, model)

    return step


def _worker(rank, world, argv, micro_batches, names, rounds):
    train_run(rank, world, argv, _stamping([]))  # warm-up: a process's first run is slower
    out = {}
    for _ in range(rounds):
        for name in names:
            stamps = []
            train_run(rank, world, argv + STRATEGIES[name], _stamping(stamps))
            starts = stamps[::micro_batches]  # the first micro batch of each step
            steps = [b - a for a, b in zip(starts[2:-1], starts[3:], strict=True)]
            out[name] = min(out.get(name, float("inf")), statistics.median(steps))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="the fastest round is printed")
    args = p.parse_args()
    try:
        import deepspeed  # noqa: F401

        names = list(STRATEGIES)
    except ImportError:
        names = [n for n in STRATEGIES if not n.startswith("DeepSpeed")]
    micro, gbs = 4, 8 * args.dp
    with tempfile.TemporaryDirectory() as tmp:
        argv = flags(counting_corpus(tmp), iters=args.steps)
        argv += ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden)]
        argv += ["--seq-length", str(args.seq), "--micro-batch-size", str(micro)]
        argv += ["--global-batch-size", str(gbs), "--log-interval", str(args.steps)]
        micro_batches = gbs // (micro * args.dp)
        out = run_distributed(_worker, args.dp, argv, micro_batches, names, args.rounds)[0]
    base = out[names[0]]
    print(
        f"DP {args.dp} gloo CPU, GPT L{args.layers} h{args.hidden} s{args.seq}, micro batch "
        f"{micro}, global batch {gbs}: median step time, fastest of {args.rounds} rounds\n"
        "| strategy | step ms | vs plain |\n|---|---|---|"
    )
    for name in names:
        print(f"| {name} | {out[name] * 1e3:.1f} | {out[name] / base:.2f}x |")


if __name__ == "__main__":
    main()

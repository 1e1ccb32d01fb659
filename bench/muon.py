"""Muon against AdamW on the demo's corpus: validation loss at the same step count, each at its
own tuned learning rate, over several seeds.

The corpus is the one `make demo` builds, the Python standard library's sources
(megatron.data.stdlib_corpus), here byte-level (ids 0-255, end-of-document 256) so the bench
needs no tokenizer training; --data-path / --vocab-size take a preprocessed corpus instead
(e.g. demo_out/stdlib_text_document with --vocab-size 4096 after `make demo`).

Both optimizers get the same model, batches, schedule (linear warmup, cosine decay to 0.1 x)
and weight decay; Muon runs with its defaults (spectral x 0.2 scale, so one --lr serves its
Muon and AdamW halves). Step 1 sweeps --lr for each on the first seed; step 2 runs each at its
best --lr on every seed. One process, CPU.

    python bench/muon.py                       # the default: a few minutes on 2 cores
    python bench/muon.py --iters 60 --seeds 2  # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.rules import validate  # noqa: E402
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder  # noqa: E402
from megatron.data.stdlib_corpus import stdlib_sources  # noqa: E402
from megatron.training.loop import pretrain  # noqa: E402

EOD = 256


def byte_corpus(directory: str, megabytes: float) -> str:
    """The standard library's sources as UTF-8 bytes, one document per file; the prefix."""
    prefix = os.path.join(directory, "stdlib_bytes")
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _, text in stdlib_sources(int(megabytes * 1e6)):
        builder.add_item(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
        builder.add_item([EOD])
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def run(args, optimizer: str, lr: float, seed: int) -> float:
    """Final validation loss of one training run."""
    argv = [
        "--optimizer", optimizer, "--lr", str(lr), "--min-lr", str(lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(args.iters // 10, 1)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--vocab-size", str(args.vocab_size), "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
        "--train-iters", str(args.iters), "--eval-interval", str(args.iters),
        "--eval-iters", str(args.eval_iters), "--log-interval", str(args.iters),
        "--data-path", args.data_path, "--split", "95,5,0", "--num-workers", "0",
        "--seed", str(seed),
    ]  # fmt: skip
    cfg = parse_args(argv, world_size=1)
    validate(cfg, "train-gpt")
    with open(os.devnull, "w") as out:
        result = pretrain(cfg, out=out)
    return result.validation[-1]["lm_loss"]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--adam-lrs", type=_floats, default=_floats("1e-3,3e-3,1e-2"))
    p.add_argument("--muon-lrs", type=_floats, default=_floats("1e-2,3e-2,1e-1"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--corpus-mb", type=float, default=3.0)
    p.add_argument("--data-path", help="a preprocessed corpus prefix (default: built here)")
    p.add_argument("--vocab-size", type=int, default=EOD + 1)
    args = p.parse_args()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if args.data_path is None:
            args.data_path = byte_corpus(tmp, args.corpus_mb)
        _report(args, start)


def _report(args, start: float) -> None:
    print(
        f"{args.layers}-layer GPT, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
        f"{args.iters} steps; validation loss (nats/token) over {args.eval_iters} batches"
    )
    best = {}
    print("\nlr sweep, seed 1:\n| optimizer | lr | validation loss |\n| --- | --- | --- |")
    for optimizer, lrs in (("adam", args.adam_lrs), ("muon", args.muon_lrs)):
        losses = {lr: run(args, optimizer, lr, 1) for lr in lrs}
        for lr, loss in losses.items():
            print(f"| {optimizer} | {lr:g} | {loss:.4f} |", flush=True)
        best[optimizer] = (min(losses, key=losses.get), losses)
        if len(lrs) > 1 and best[optimizer][0] in (min(lrs), max(lrs)):
            print(f"| {optimizer} | (best lr at the end of the sweep: widen it) | |")
    print(f"\nat each one's best lr, {args.seeds} seeds:")
    seeds = list(range(1, args.seeds + 1))
    head = " | ".join(f"seed {s}" for s in seeds)
    print(f"| optimizer | lr | {head} | mean | std |\n|{' --- |' * (len(seeds) + 4)}")
    for optimizer, (lr, losses) in best.items():
        finals = [losses[lr] if s == 1 else run(args, optimizer, lr, s) for s in seeds]
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        cells = " | ".join(f"{x:.4f}" for x in finals)
        print(f"| {optimizer} | {lr:g} | {cells} | {statistics.mean(finals):.4f} | {std:.4f} |")
    print(f"\n{time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()

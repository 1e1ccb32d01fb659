"""What a generation step's text costs on the thread that drives the model: decoding all the
ids so far at every step (what streaming did before) against the incremental detokenizer
(megatron/inference/detokenizer.py), at several generated lengths.

    .venv/bin/python bench/detokenize.py [--lengths 256 1024 4096] [--repeat 3]

Uses the fixture GPT-2 BPE (tests/fixtures/megatron-mmap) on ids of English and multi-byte
text, and prints the mean cost per step (microseconds) of each method over a whole generation
of each length, side by side. The incremental texts are checked against the full decode.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.tokenizers import build_tokenizer  # noqa: E402
from megatron.inference.detokenizer import IncrementalText  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "megatron-mmap")
TEXT = "def add(a, b):\n    return a + b  # 分布式训练 🙂 café\n"


def full_redecode(tokenizer, ids: list[int]) -> str:
    text = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.detokenize(ids[:k])
    return text


def incremental(tokenizer, ids: list[int]) -> str:
    inc = IncrementalText(tokenizer)
    text = "".join(inc.add(t) for t in ids)
    return text + inc.pending


def per_step_us(fn, tokenizer, ids, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn(tokenizer, ids)
        times.append(time.perf_counter() - tic)
    return statistics.median(times) / len(ids) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeat", type=int, default=3, help="timed runs per method (median)")
    args = p.parse_args(argv)
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=os.path.join(FIXTURE, "vocab.json"),
        merge_file=os.path.join(FIXTURE, "merges.txt"),
    )
    base = tokenizer.tokenize(TEXT)
    print(f"{'tokens':>7} {'full re-decode us/step':>23} {'incremental us/step':>20} {'ratio':>7}")
    for n in args.lengths:
        ids = (base * (n // len(base) + 1))[:n]
        if incremental(tokenizer, ids) != tokenizer.detokenize(ids):
            raise SystemExit(f"incremental text differs from the full decode at {n} tokens")
        full = per_step_us(full_redecode, tokenizer, ids, args.repeat)
        inc = per_step_us(incremental, tokenizer, ids, args.repeat)
        print(f"{n:>7} {full:>23.1f} {inc:>20.1f} {full / inc:>6.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

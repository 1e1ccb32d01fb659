"""What verifying a checkpoint shard's CRC-32 costs next to loading it.

    .venv/bin/python bench/checkpoint_checksum.py [--gb 1.0] [--repeat 3] [--dir /tmp]

Writes a ~1 GB checkpoint-like shard (a dict of fp32 tensors, torch.save'd) into a temporary
directory and times `megatron.checkpoint.storage.file_crc32` (what `load_shard` runs before
unpickling, and what the commit runs once per shard) against `torch.load(weights_only=True)` of
the same file. Both read from the page cache after the first pass, so the figures are the CPU
cost, the part the check adds to every load; a cold disk read costs the same for both. Prints
the median over --repeat runs.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.storage import file_crc32  # noqa: E402


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm the page cache (and the allocator)
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="shard size in GB (default 1.0)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per method (default 3)")
    p.add_argument("--dir", default=None, help="where to write the shard (default: $TMPDIR)")
    args = p.parse_args(argv)
    numel = int(args.gb * 1e9 / 4)
    tensors = 16  # a model state is many tensors, not one
    gen = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn(numel // tensors, generator=gen) for i in range(tensors)
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "model_optim_rng.pt")
        torch.save(state, path)
        del state
        size = os.path.getsize(path)
        rows = [
            ("crc32 (file_crc32)", median_seconds(lambda: file_crc32(path), args.repeat)),
            (
                "torch.load weights_only",
                median_seconds(lambda: torch.load(path, weights_only=True), args.repeat),
            ),
        ]
    print(f"{'method':<26}{'bytes':>15}{'seconds':>10}{'GB/s':>8}")
    for name, sec in rows:
        print(f"{name:<26}{size:>15,}{sec:>10.3f}{size / sec / 1e9:>8.2f}")
    crc, load = rows[0][1], rows[1][1]
    print(f"checking adds {100 * crc / load:.0f}% to a load; {crc / (size / 1e9):.3f} s per GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

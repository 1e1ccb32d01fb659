"""Checkpoint cost at scale on CPU: the training stall per save (sync vs --async-save), save and
load throughput, and the peak host memory of a resharding load against a same-layout load.

    .venv/bin/python bench/checkpoint.py [--layers 24 --hidden 1024 --heads 16] [--dir /tmp]

A GPT (default ~350M parameters: 24 layers, hidden 1024, vocab 50257) on 4 gloo ranks at
TP2 x PP2, fp32 with Adam (moments filled by one optimizer step on zero gradients), so each
checkpoint holds the weights and both moments, ~12 bytes a parameter.
  stall sync    backend.save() with synchronous writes: shard write + commit (max over ranks)
  stall async   backend.save() with --async-save: the host copy of the state (max over ranks);
                the first async save allocates the host buffers, later ones copy into them
  async total   from the save call until the background write is committed
  save GB/s     checkpoint bytes / stall sync
  load          a fresh 4-rank spawn per layout: TP2 x PP2 (same layout) and TP1 x PP4
                (resharded on load); the seconds of load_training_state (max over ranks),
                GB/s = checkpoint bytes / seconds, and for the rank whose load added the most
                anonymous RSS (sampled every 5 ms; memory-mapped file pages are page cache,
                not counted) that peak next to the size of its own state (weights + moments)
Every figure is from the same machine and run; the page cache is warm for the loads (the
files were just written), so they show the CPU and memory cost, not a cold disk's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.distributed import run_distributed  # noqa: E402

VOCAB = 50257
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    """Anonymous resident bytes: the process's own memory, not the page cache of files it has
    memory-mapped (clean pages the kernel can drop at any time)."""
    with open("/proc/self/statm") as f:
        _, resident, file_backed = (int(x) for x in f.read().split()[:3])
    return (resident - file_backed) * _PAGE


class _PeakRSS:
    """The highest RSS seen while the block runs (a sampling thread)."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _backend(argv: list[str], world: int):
    from megatron.config.cli import parse_args
    from megatron.initialize import initialize_megatron
    from megatron.training.step import NativeBackend, forward_step

    cfg = parse_args(argv, world_size=world)
    rt = initialize_megatron(cfg)
    backend = NativeBackend(cfg, rt, forward_step)
    return cfg, backend


def _model_flags(a, root: str, tp: int, pp: int) -> list[str]:
    return [
        *("--num-layers", str(a.layers), "--hidden-size", str(a.hidden)),
        *("--num-attention-heads", str(a.heads), "--seq-length", "128"),
        *("--max-position-embeddings", "1024", "--vocab-size", str(VOCAB)),
        *("--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "10"),
        *("--lr", "1e-4", "--tensor-model-parallel-size", str(tp)),
        *("--pipeline-model-parallel-size", str(pp), "--save", root, "--load", root),
    ]


def _save_worker(rank, world, argv):
    import torch.distributed as dist

    from megatron.checkpoint.async_save import AsyncSaver
    from megatron.training.state import TrainState

    cfg, backend = _backend(argv, world)
    backend.optimizer.step()  # zero gradients: Adam's moments now exist, at their real size
    out = {}
    saver = AsyncSaver(backend.rt.device)
    for it, mode in ((1, "sync"), (2, "async, 1st"), (3, "async")):
        backend.saver = None if mode == "sync" else saver  # the 2nd async save reuses buffers
        dist.barrier()
        tic = time.perf_counter()
        backend.save(TrainState(iteration=it))
        out[f"stall {mode}"] = time.perf_counter() - tic
        backend.wait_for_save()
        out[f"total {mode}"] = time.perf_counter() - tic
    return out


def _load_worker(rank, world, argv):
    import gc

    cfg, backend = _backend(argv, world)
    gc.collect()
    with _PeakRSS() as mem:
        tic = time.perf_counter()
        backend.load()
        seconds = time.perf_counter() - tic
    own = sum(t.numel() * t.element_size() for t in backend.model.state_dict().values())
    return {"seconds": seconds, "added": mem.peak - mem.start, "own": 3 * own}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dir", default=None, help="where to write the checkpoints ($TMPDIR)")
    a = p.parse_args(argv)
    params = 12 * a.layers * a.hidden**2 + (VOCAB + 1024) * a.hidden
    print(f"GPT {a.layers} layers, hidden {a.hidden}: ~{params / 1e6:.0f}M parameters, 4 ranks")
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        saves = run_distributed(_save_worker, 4, _model_flags(a, root, 2, 2), timeout=3600)
        size = _dir_bytes(os.path.join(root, "iter_0000003")) / 1e9
        rows = {k: max(r[k] for r in saves) for k in saves[0]}
        print(f"checkpoint: {size:.2f} GB (weights + Adam moments), TP2 x PP2")
        print("| save | stall (s) | total (s) | GB/s |\n|---|---|---|---|")
        for mode in ("sync", "async, 1st", "async"):
            stall, total = rows[f"stall {mode}"], rows[f"total {mode}"]
            print(f"| {mode} | {stall:.2f} | {total:.2f} | {size / total:.2f} |")
        print(f"async stall / sync save: {100 * rows['stall async'] / rows['stall sync']:.1f}%")
        print(
            "| load on | seconds | GB/s | rank's state (GB) | peak RSS added (GB) |\n"
            "|---|---|---|---|---|"
        )
        for name, tp, pp in (("TP2 x PP2 (same layout)", 2, 2), ("TP1 x PP4 (resharded)", 1, 4)):
            loads = run_distributed(_load_worker, 4, _model_flags(a, root, tp, pp), timeout=3600)
            seconds = max(r["seconds"] for r in loads)
            worst = max(loads, key=lambda r: r["added"])  # the rank that added the most
            own, added = worst["own"] / 1e9, worst["added"] / 1e9
            print(f"| {name} | {seconds:.2f} | {size / seconds:.2f} | {own:.2f} | {added:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

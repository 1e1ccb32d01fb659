"""Where tools/preprocess_data.py writes: one builder per JSON key, under temporary names until
the whole run succeeded.

`--dataset-impl mmap` (the default) writes Megatron's mmap format with the smallest token dtype
that holds the vocab; `lazy` and `cached` write v1.x's older TNTIDX format (one format for both
names; int32 tokens, as v1.x's IndexedDatasetBuilder always wrote), for v1.x tools that need it.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
from megatron.data.legacy_indexed_dataset import LegacyIndexedDatasetBuilder

DATASET_IMPLS = ("mmap", "lazy", "cached")


def token_dtype(dataset_impl: str, vocab_size: int | None) -> np.dtype:
    """The dtype of the written tokens (v1.x's make_builder rule)."""
    return np.dtype(best_dtype(vocab_size) if dataset_impl == "mmap" else np.int32)


class OutputWriteError(RuntimeError):
    """Writing an output failed (disk full, quota, EIO); the message names the file and the
    free space there. Nothing is left under the final names."""


def _write_error(path: str, error: OSError) -> OutputWriteError:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free on {directory}"
    except OSError as e:
        free = f"free space on {directory} unknown ({e.strerror or e})"
    reason = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
    return OutputWriteError(
        f"cannot write {path}: {reason}; {free}. Nothing was written under the final names; "
        "free space or pass another --output-prefix, then run again"
    )


class Outputs:
    """One builder per key, writing to temporary names until `commit()` renames them."""

    def __init__(self, prefix: str, keys: list[str], level: str, dtype, dataset_impl="mmap"):
        if dataset_impl not in DATASET_IMPLS:
            raise ValueError(f"--dataset-impl {dataset_impl!r}: choose one of {DATASET_IMPLS}")
        builder = (
            MMapIndexedDatasetBuilder if dataset_impl == "mmap" else LegacyIndexedDatasetBuilder
        )
        self.final = {k: f"{prefix}_{k}_{level}" for k in keys}
        self.tag = f".tmp-{os.getpid()}"
        self.builders = {k: builder(f"{p}.bin{self.tag}", dtype) for k, p in self.final.items()}

    def add(self, result) -> None:
        """Append a ChunkResult (preprocess.py): every key's documents of one chunk."""
        for k, r in result.per_key.items():
            try:
                self.builders[k].add_batch(r.tokens, r.seq_lengths, r.seqs_per_doc)
            except OSError as e:
                raise _write_error(f"{self.final[k]}.bin", e) from e

    def commit(self) -> list[str]:
        for k, p in self.final.items():
            try:
                self.builders[k].finalize(f"{p}.idx{self.tag}")
            except OSError as e:
                raise _write_error(f"{p}.idx", e) from e
            os.replace(f"{p}.bin{self.tag}", f"{p}.bin")
            os.replace(f"{p}.idx{self.tag}", f"{p}.idx")
        return list(self.final.values())

    def discard(self) -> None:
        for k, p in self.final.items():
            self.builders[k].abort()
            for path in (f"{p}.bin{self.tag}", f"{p}.idx{self.tag}"):
                if os.path.exists(path):
                    os.remove(path)

"""`--data-impl {mmap,lazy,cached,infer}`: which reader opens PREFIX.bin/.idx.

`mmap` is the format tools/preprocess_data.py writes (indexed_dataset.py). `lazy` and `cached`
read v1.x's older TNTIDX files (legacy_indexed_dataset.py): one format, read on demand or held
in memory. `infer` picks by the index's magic (TNTIDX -> lazy: same samples as cached, without
holding the whole .bin in memory). A file that does not match an explicit choice fails naming
the flag and the value that reads it.
"""

from __future__ import annotations

import os

from megatron.data.indexed_dataset import (
    LEGACY_MAGIC,
    MAGIC,
    IndexedDatasetError,
    MMapIndexedDataset,
    index_file_path,
    prefix_hint,
)
from megatron.data.legacy_indexed_dataset import LegacyIndexedDataset

DATA_IMPLS = ("infer", "mmap", "lazy", "cached")


def infer_dataset_impl(prefix: str | os.PathLike) -> str:
    """'mmap' or 'lazy' from the first bytes of PREFIX.idx; an unknown magic is an error."""
    path = index_file_path(prefix)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: index file not found ({prefix_hint(prefix)})")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        return "mmap"
    if head[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        return "lazy"
    raise IndexedDatasetError(
        f"{path}: magic {head!r} is neither Megatron's mmap index ({MAGIC!r}) nor the older "
        f"lazy/cached one ({LEGACY_MAGIC!r}); not a Megatron dataset index"
    )


def make_indexed_dataset(prefix: str | os.PathLike, impl: str = "infer", warmup: bool = False):
    """The reader `impl` names for PREFIX (see the module docstring); `warmup` reads every page
    of the .bin once at load (--mmap-warmup)."""
    if impl not in DATA_IMPLS:
        raise ValueError(f"--data-impl {impl!r}: choose one of {', '.join(DATA_IMPLS)}")
    found = infer_dataset_impl(prefix)
    if impl == "infer":
        impl = found
    elif (impl == "mmap") != (found == "mmap"):
        fix = "mmap" if found == "mmap" else "lazy (or cached)"
        what = "the mmap format" if found == "mmap" else "the older TNTIDX (lazy/cached) format"
        raise IndexedDatasetError(
            f"{index_file_path(prefix)}: --data-impl {impl} does not read this file, which is "
            f"{what}. Fix: pass --data-impl {fix}, or --data-impl infer"
        )
    if impl == "mmap":
        return MMapIndexedDataset(prefix, warmup=warmup)
    return LegacyIndexedDataset(prefix, cached=impl == "cached", warmup=warmup)

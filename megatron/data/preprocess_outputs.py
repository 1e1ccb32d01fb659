"""Where tools/preprocess_data.py writes: one builder per JSON key, under temporary names until
the whole run succeeded; then each pair is made visible by dataset_pair.commit_pair (a sidecar
PREFIX.idx.json first, the `.idx` last), so an interrupted rerun is refused at open, never read
as a new `.bin` beside an old `.idx`. The sidecar also records the largest token id and the
tokenizer's fingerprint, which training checks against its own tokenizer.

Temporary files of killed runs (`PREFIX.bin.tmp-PID` ...) are removed by the next run writing
the same prefix when their process is gone, and reported when it still runs.

`--dataset-impl mmap` (the default) writes Megatron's mmap format with the smallest token dtype
that holds the vocab; `lazy` and `cached` write v1.x's older TNTIDX format (one format for both
names; int32 tokens, as v1.x's IndexedDatasetBuilder always wrote), for v1.x tools that need it.
"""

from __future__ import annotations

import os
import re

import numpy as np

from megatron.data.dataset_pair import SIDECAR_SUFFIX, commit_pair
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
from megatron.data.legacy_indexed_dataset import LegacyIndexedDatasetBuilder
from megatron.fileio import disk_space, os_reason

DATASET_IMPLS = ("mmap", "lazy", "cached")


def token_dtype(dataset_impl: str, vocab_size: int | None) -> np.dtype:
    """The dtype of the written tokens (v1.x's make_builder rule)."""
    return np.dtype(best_dtype(vocab_size) if dataset_impl == "mmap" else np.int32)


class OutputWriteError(RuntimeError):
    """Writing an output failed (disk full, quota, EIO); the message names the file and the
    free space there. Nothing is left under the final names."""


def _write_error(path: str, error: OSError) -> OutputWriteError:
    directory = os.path.dirname(os.path.abspath(path))
    free = disk_space(directory, lambda usage: f"{usage.free / 2**20:.1f} MiB free on {directory}")
    return OutputWriteError(
        f"cannot write {path}: {os_reason(error)}; {free}. Nothing was written under the final "
        "names; free space or pass another --output-prefix, then run again"
    )


class Outputs:
    """One builder per key, writing to temporary names until `commit()` renames them."""

    def __init__(
        self, prefix: str, keys: list[str], level: str, dtype, dataset_impl="mmap", tokenizer=None
    ):
        if dataset_impl not in DATASET_IMPLS:
            raise ValueError(f"--dataset-impl {dataset_impl!r}: choose one of {DATASET_IMPLS}")
        builder = (
            MMapIndexedDatasetBuilder if dataset_impl == "mmap" else LegacyIndexedDatasetBuilder
        )
        self.final = {k: f"{prefix}_{k}_{level}" for k in keys}
        self.tag = f".tmp-{os.getpid()}"
        self.builders = {k: builder(f"{p}.bin{self.tag}", dtype) for k, p in self.final.items()}
        self.facts = {k: {"dtype": np.dtype(dtype).name, "max_token_id": -1} for k in keys}
        if tokenizer is not None:  # {"type", "vocab_size", "eod", "probe"}: tokenizer_fingerprint
            for f in self.facts.values():
                f["tokenizer"] = tokenizer

    def add(self, result) -> None:
        """Append a ChunkResult (preprocess.py): every key's documents of one chunk."""
        for k, r in result.per_key.items():
            try:
                self.builders[k].add_batch(r.tokens, r.seq_lengths, r.seqs_per_doc)
            except OSError as e:
                raise _write_error(f"{self.final[k]}.bin", e) from e
            if len(r.tokens):
                top = int(r.tokens.max())
                self.facts[k]["max_token_id"] = max(self.facts[k]["max_token_id"], top)

    def commit(self) -> list[str]:
        for k, p in self.final.items():
            try:
                self.builders[k].finalize(f"{p}.idx{self.tag}")
            except OSError as e:
                raise _write_error(f"{p}.idx", e) from e
            try:
                commit_pair(p, f"{p}.bin{self.tag}", f"{p}.idx{self.tag}", **self.facts[k])
            except OSError as e:
                raise _write_error(f"{p}{SIDECAR_SUFFIX}", e) from e
        return list(self.final.values())

    def discard(self) -> None:
        for k, p in self.final.items():
            self.builders[k].abort()
            for ext in (".bin", ".idx", SIDECAR_SUFFIX):
                if os.path.exists(f"{p}{ext}{self.tag}"):
                    os.remove(f"{p}{ext}{self.tag}")

    def clean_stale(self) -> list[str]:
        """Remove the temporary files that killed runs left under these prefixes; one line per
        file removed or kept (its process still runs: another run writing the same prefix?)."""
        lines = []
        for p in self.final.values():
            for path, pid in stale_temporaries(p):
                if pid == os.getpid():
                    continue
                if _alive(pid):
                    lines.append(f"kept {path}: process {pid} that writes it is still running")
                    continue
                try:
                    os.remove(path)
                    lines.append(f"removed {path}, left by a killed run (pid {pid})")
                except OSError as e:
                    lines.append(f"cannot remove {path} (left by pid {pid}): {e.strerror or e}")
        return lines


_TMP = re.compile(r"(\.bin|\.idx|\.idx\.json)\.tmp-(\d+)$")


def stale_temporaries(prefix: str) -> list[tuple[str, int]]:
    """[(path, pid)] of PREFIX.{bin,idx,idx.json}.tmp-PID files."""
    directory = os.path.dirname(os.path.abspath(prefix))
    name = os.path.basename(prefix)
    out = []
    for f in sorted(os.listdir(directory)):
        m = _TMP.search(f)
        if m and f[: m.start()] == name:
            out.append((os.path.join(directory, f), int(m.group(2))))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True

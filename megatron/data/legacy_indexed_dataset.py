"""Megatron v1.x's older "TNTIDX" indexed dataset (`--data-impl lazy` / `cached`): read and write.

v1.x (after fairseq) wrote it with IndexedDatasetBuilder for `--dataset-impl lazy|cached`; both
names are one file format and differ only in how it is read. Layout (little-endian,
no padding):

`.idx`
| offset        | field                                                      | type       |
| ------------- | ---------------------------------------------------------- | ---------- |
| 0             | magic b"TNTIDX\\x00\\x00"                                  | 8 bytes    |
| 8             | version = 1                                                | uint64     |
| 16            | dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,    | uint64     |
|               | 6 and 7 float64 in v1.x's map, 8 uint16)                   |            |
| 24            | element size in bytes                                      | uint64     |
| 32            | N = number of items (sequences)                            | uint64     |
| 40            | S = number of shape entries (= N for 1-D token arrays)     | uint64     |
| 48            | D = length of the document index                           | uint64     |
| 56            | dim_offsets: item i's shape is sizes[dim_offsets[i]:       | int64[N+1] |
|               | dim_offsets[i+1]] (0, 1, ..., N for 1-D items)             |            |
| 64 + 8N       | data_offsets, in elements: item i is .bin elements         | int64[N+1] |
|               | [data_offsets[i], data_offsets[i+1])                       |            |
| 72 + 16N      | sizes: the token count of each sequence                    | int64[S]   |
| 72 + 16N + 8S | document index: 0, then the item count at each document end | int64[D]  |

`.bin`: the items' elements concatenated (v1.x always wrote int32 tokens, code 4, size 4).

`lazy` reads each sequence from the `.bin` when asked (os.pread: no shared file position, so
forked DataLoader workers never race); `cached` reads the whole `.bin` into memory at load.
Every problem raises IndexedDatasetError naming the file.
"""

from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from megatron.data.indexed_dataset import (
    LEGACY_MAGIC,
    IndexedDatasetError,
    TokenSequences,
    data_file_path,
    index_file_path,
    open_pair,
    prefix_hint,
    warm_up_file,
)

HEADER_SIZE = 56  # 8 magic + 8 version + 8 code + 8 element size + 8 N + 8 S + 8 D
LEGACY_DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,  # v1.x: np.float (= Python float = float64)
    7: np.float64,  # v1.x: np.double
    8: np.uint16,
}
_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3}
_CODES.update({np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint16): 8})


def _read_legacy_index(idx_path: str) -> dict:
    """The header and the four arrays of a TNTIDX index, checked against each other."""
    if not os.path.exists(idx_path):
        raise FileNotFoundError(f"{idx_path}: index file not found ({prefix_hint(idx_path[:-4])})")
    raw = np.fromfile(idx_path, dtype=np.uint8)
    if raw[:8].tobytes() != LEGACY_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: magic {raw[:9].tobytes()!r} is not the lazy/cached 'TNTIDX' format"
        )
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(f"{idx_path}: truncated header ({len(raw)} bytes)")
    version, code, elsize, n, s, d = struct.unpack("<6Q", raw[8:HEADER_SIZE].tobytes())
    if version != 1:
        raise IndexedDatasetError(f"{idx_path}: TNTIDX version {version}, expected 1")
    if code not in LEGACY_DTYPES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}; the file is damaged")
    dtype = np.dtype(LEGACY_DTYPES[code])
    if elsize != dtype.itemsize:
        raise IndexedDatasetError(
            f"{idx_path}: element size {elsize} does not match dtype code {code} ({dtype}, "
            f"{dtype.itemsize} bytes); the file is damaged"
        )
    expected = HEADER_SIZE + 8 * (2 * (n + 1) + s + d)
    if len(raw) != expected:
        raise IndexedDatasetError(
            f"{idx_path}: {len(raw)} bytes, but its header promises {expected} ({n} items, "
            f"{s} sizes, {d} document entries); the file is truncated, damaged, or a fairseq "
            "index without a document index"
        )
    longs = raw[HEADER_SIZE:].view("<i8")
    cuts = np.cumsum([0, n + 1, n + 1, s, d])
    dims, data, sizes, doc_idx = (longs[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    return {"dtype": dtype, "n": n, "dims": dims, "data": data, "sizes": sizes, "doc_idx": doc_idx}


def _check_legacy_index(idx_path: str, ix: dict) -> None:
    n = ix["n"]
    if not np.array_equal(ix["dims"], np.arange(n + 1)):
        raise IndexedDatasetError(
            f"{idx_path}: items are not 1-D token sequences (dim_offsets is not 0, 1, ..., {n}); "
            "only token datasets can be read"
        )
    data, sizes, doc_idx = ix["data"], ix["sizes"], ix["doc_idx"]
    if data[0] != 0 or not np.array_equal(np.diff(data), sizes):
        wrong = np.flatnonzero(np.diff(data) != sizes)
        i = int(wrong[0]) if len(wrong) else 0
        raise IndexedDatasetError(
            f"{idx_path}: sequence {i} has {int(sizes[i]) if n else 0} tokens, but its data "
            "offsets disagree; the index is damaged"
        )
    if n and sizes.min() < 0:
        raise IndexedDatasetError(f"{idx_path}: negative sequence sizes; the index is damaged")
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise IndexedDatasetError(
            f"{idx_path}: document index must rise from 0 to {n} items; the file is damaged "
            "(v1.x's merge_file_ wrote such indices: re-create the dataset)"
        )


class LegacyIndexedDataset(TokenSequences):
    """Read-only TNTIDX dataset with the interface of MMapIndexedDataset: `sizes`, `doc_idx`,
    `dtype`, `len`, `get(i, offset, length)`, `ds[i]`, `ds[a:b]`. `cached=True` holds the
    whole `.bin` in memory; otherwise each `get` reads its bytes from the file."""

    def __init__(self, prefix: str | os.PathLike, cached: bool = False, warmup: bool = False):
        self.prefix, self.cached = str(prefix), cached
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        ix = _read_legacy_index(idx_path)
        _check_legacy_index(idx_path, ix)
        self.dtype = ix["dtype"]
        self.sizes = ix["sizes"]  # int64[N]
        self.doc_idx = ix["doc_idx"]  # int64[D]
        self._offsets = ix["data"]  # int64[N + 1], in elements
        self.pair = open_pair(prefix)
        expected = int(self._offsets[-1]) * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: {actual} bytes, but the index points to {expected}; the .bin is "
                f"truncated or belongs to another index (dtype {self.dtype})"
            )
        self.warmed_bytes = warm_up_file(bin_path) if warmup else 0
        self._open()

    def _open(self) -> None:
        bin_path = data_file_path(self.prefix)
        self._fd = None
        self._data = np.fromfile(bin_path, dtype=self.dtype) if self.cached else None
        if not self.cached:
            self._fd = os.open(bin_path, os.O_RDONLY)

    def __getstate__(self):  # a DataLoader worker started by spawn/forkserver re-opens the file
        state = dict(self.__dict__)
        state["_fd"] = state["_data"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def _read(self, i: int, offset: int, length: int) -> np.ndarray:
        start = int(self._offsets[i]) + offset
        if self._data is not None:
            return self._data[start : start + length]
        nbytes = length * self.dtype.itemsize
        raw = os.pread(self._fd, nbytes, start * self.dtype.itemsize)
        if len(raw) != nbytes:
            raise IndexedDatasetError(f"{data_file_path(self.prefix)}: short read (file changed?)")
        return np.frombuffer(raw, dtype=self.dtype)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """All tokens of sequences [start, stop) as one flat array (for conversion)."""
        a, b = int(self._offsets[start]), int(self._offsets[stop])
        if self._data is not None:
            return self._data[a:b]
        raw = os.pread(self._fd, (b - a) * self.dtype.itemsize, a * self.dtype.itemsize)
        return np.frombuffer(raw, dtype=self.dtype)

    def __repr__(self) -> str:
        kind = "cached" if self.cached else "lazy"
        return (
            f"LegacyIndexedDataset({os.path.basename(self.prefix)!r}, {kind}, sequences="
            f"{len(self)}, documents={self.num_documents}, dtype={self.dtype})"
        )


class LegacyIndexedDatasetBuilder:
    """Writes TNTIDX files exactly as v1.x's IndexedDatasetBuilder did (int32 tokens by default),
    with the streaming interface of MMapIndexedDatasetBuilder (add_batch / finalize / abort)."""

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of {list(_CODES)}")
        self._file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize() / abort()
        self._ends = array("q", [0])  # data_offsets: running element count
        self._doc_idx = array("q", [0])

    def add_item(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self._ends.append(self._ends[-1] + len(arr))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._ends) - 1)

    def add_document(self, sequences) -> None:
        for seq in sequences:
            self.add_item(seq)
        self.end_document()

    def add_batch(self, tokens, seq_lengths, seqs_per_doc) -> None:
        """Many documents at once: flat tokens, each sequence's length, sequences per doc."""
        self._file.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        start = len(self._ends) - 1
        ends = self._ends[-1] + np.cumsum(np.asarray(seq_lengths, dtype=np.int64))
        self._ends.frombytes(ends.astype(np.int64).tobytes())
        docs = start + np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64))
        self._doc_idx.frombytes(docs.astype(np.int64).tobytes())

    def abort(self) -> None:
        self._file.close()

    def finalize(self, idx_path: str | os.PathLike) -> None:
        self._file.close()
        ends = np.frombuffer(self._ends, dtype=np.int64)
        n = len(ends) - 1
        with open(idx_path, "wb") as f:
            f.write(LEGACY_MAGIC)
            f.write(struct.pack("<QQQ", 1, _CODES[self.dtype], self.dtype.itemsize))
            f.write(struct.pack("<QQQ", n, n, len(self._doc_idx)))
            f.write(np.arange(n + 1, dtype="<i8").tobytes())  # dim_offsets: 1-D items
            f.write(ends.astype("<i8").tobytes())
            f.write(np.diff(ends).astype("<i8").tobytes())  # sizes
            f.write(np.frombuffer(self._doc_idx, dtype=np.int64).astype("<i8").tobytes())

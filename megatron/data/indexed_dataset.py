"""Megatron's "mmap" indexed dataset (PREFIX.bin + PREFIX.idx), byte-compatible both ways.

`.idx` layout (little-endian, no padding; see FORMATS.md): magic b"MMIDIDX\\x00\\x00", version
uint64 = 1, dtype code uint8, N uint64 (sequences), D uint64 (document index length), then
sizes int32[N], pointers int64[N] (byte offsets into .bin), doc_idx int64[D].
`.bin`: all sequences' tokens concatenated in that dtype.

Every header problem raises `IndexedDatasetError` naming the file, never an `assert`. A pair
whose sidecar (PREFIX.idx.json, dataset_pair.py) says its `.bin` and `.idx` were not written
together (an interrupted rerun) is refused naming both files. Opening
also checks that every sequence starts where the previous one ends (pointers against sizes,
vectorized) and that the last one ends at the end of the `.bin`, so an index that claims more
or fewer tokens for any sequence than the `.bin` holds is refused, naming the sequence.

`--mmap-warmup` (`warmup=True`) touches every page of both mappings once at load, so later
reads find them mapped instead of faulting to disk (v1.x's skip_warmup=False).
Megatron's older TNTIDX format (`--data-impl lazy/cached`) lives in legacy_indexed_dataset.py.
"""

from __future__ import annotations

import difflib
import os
import struct
from array import array
from pathlib import Path

import numpy as np

from megatron.config.schema_data import prefix_names_a_file
from megatron.data.dataset_pair import PairMismatch, verify_pair

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype + 8 N + 8 D

DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDatasetError(ValueError):
    """A damaged or foreign .bin/.idx file; the message names the file and what is wrong."""


_CHECK_BLOCK = 1 << 24  # sequences per vectorized pointer check: bounds its temporaries


def dtype_vocab_problem(dtype, vocab_size: int | None) -> str | None:
    """Why token ids of a vocab of `vocab_size` do not fit `dtype`, or None if they do.

    A dtype code of the right byte width but the wrong type (int16 instead of uint16 for a
    50k vocab) passes every size check and reads ids above 32767 back as negative numbers.
    """
    dtype = np.dtype(dtype)
    if vocab_size is None:
        return None
    if dtype.kind not in "iu":
        return f"token dtype {dtype} (dtype code {CODES[dtype]}) is not an integer type"
    if np.iinfo(dtype).max < vocab_size - 1:
        return (
            f"token dtype {dtype} (dtype code {CODES[dtype]}) holds ids up to "
            f"{np.iinfo(dtype).max}, but the vocab has {vocab_size} (ids up to {vocab_size - 1})"
        )
    return None


def best_dtype(vocab_size: int | None) -> type:
    """uint16 when every id fits (vocab < 65500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


_PAGE = 4096
_WARMUP_BLOCK = 1 << 26  # bytes per touched block: bounds the temporaries


def touch_pages(buffer: np.ndarray) -> int:
    """Read one byte of every page of a uint8 mapping (faulting each page in); returns the
    number of bytes covered, i.e. len(buffer)."""
    for start in range(0, len(buffer), _WARMUP_BLOCK):
        int(buffer[start : start + _WARMUP_BLOCK : _PAGE].sum(dtype=np.uint64))
    return len(buffer)


def warm_up_file(path: str | os.PathLike) -> int:
    """Read every byte of a file once (into the page cache); returns the bytes read."""
    total, block = 0, bytearray(_WARMUP_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            total += n
    return total


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


class MMapIndexedDatasetBuilder:
    """Streams token arrays to PREFIX.bin; `finalize(idx_path)` writes the index.

    Sizes are kept in compact arrays (4 bytes a sequence), so memory stays small however large
    the corpus.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of {list(CODES)}")
        self._file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize()
        self._sizes = array("i")
        self._doc_idx = array("q", [0])

    def add_item(self, tokens) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self._sizes.append(len(arr))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, sequences) -> None:
        for seq in sequences:
            self.add_item(seq)
        self.end_document()

    def add_batch(self, tokens, seq_lengths, seqs_per_doc) -> None:
        """Append many documents at once: all their tokens as one flat array, the length of each
        sequence, and how many sequences each document has (1 without sentence splitting)."""
        self._file.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        start = len(self._sizes)
        self._sizes.frombytes(np.asarray(seq_lengths, dtype=np.int32).tobytes())
        ends = start + np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64))
        self._doc_idx.frombytes(ends.astype(np.int64).tobytes())

    def merge_file_(self, prefix: str | os.PathLike) -> None:
        """Append every document of an existing dataset (same dtype) to this one."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(prefix)}: dtype {other.dtype} differs from {self.dtype}; "
                "merge only datasets made with the same tokenizer"
            )
        offset = len(self._sizes)
        self._sizes.frombytes(other.sizes.astype(np.int32).tobytes())
        self._doc_idx.frombytes((other.doc_idx[1:] + offset).astype(np.int64).tobytes())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._file.write(chunk)

    def abort(self) -> None:
        """Close the .bin without an index; the caller removes the partial files."""
        self._file.close()

    def finalize(self, idx_path: str | os.PathLike) -> None:
        self._file.close()
        write_index(
            idx_path,
            self.dtype,
            np.frombuffer(self._sizes, dtype=np.int32),
            np.frombuffer(self._doc_idx, dtype=np.int64),
        )


def write_index(path, dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.asarray(doc_idx, dtype="<i8").tobytes())


def prefix_hint(prefix: str | os.PathLike) -> str:
    """Why PREFIX.idx may be missing: a prefix given with its .bin/.idx, or a wrong prefix."""
    named_file = prefix_names_a_file(str(prefix))
    if named_file:
        return "; ".join(named_file)
    folder, name = os.path.split(os.path.abspath(prefix))
    prefixes = (
        [f[:-4] for f in os.listdir(folder) if f.endswith(".idx")] if os.path.isdir(folder) else []
    )
    close = difflib.get_close_matches(name, prefixes, n=1)
    hint = f"did you mean {os.path.join(os.path.dirname(str(prefix)), close[0])}? " if close else ""
    return f"{hint}is the --data-path prefix right? It names PREFIX for PREFIX.bin and PREFIX.idx"


def open_pair(prefix: str | os.PathLike) -> dict | None:
    """Check that PREFIX.bin exists and belongs to PREFIX.idx (the sidecar's record, or None)."""
    bin_path = data_file_path(prefix)
    if not os.path.exists(bin_path):
        raise FileNotFoundError(f"{bin_path}: data file not found next to its index")
    try:
        return verify_pair(prefix)
    except PairMismatch as e:
        raise IndexedDatasetError(str(e)) from None


def _read_header(idx_path: str) -> tuple[np.dtype, int, int]:
    if not os.path.exists(idx_path):
        raise FileNotFoundError(f"{idx_path}: index file not found ({prefix_hint(idx_path[:-4])})")
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head.startswith(LEGACY_MAGIC):
        raise IndexedDatasetError(
            f"{idx_path}: this is Megatron's legacy 'TNTIDX' (lazy/cached) format, not mmap. "
            "Fix: pass --data-impl infer (or lazy / cached) to read it, or convert it once with "
            "tools/convert_indexed_dataset.py"
        )
    if head[:9] != MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: bad magic {head[:9]!r} (expected {MAGIC!r}); not a Megatron mmap index"
        )
    if len(head) < HEADER_SIZE:
        raise IndexedDatasetError(f"{idx_path}: truncated header ({len(head)} bytes)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedDatasetError(f"{idx_path}: index version {version}, expected {VERSION}")
    code = head[17]
    if code not in DTYPES:
        raise IndexedDatasetError(
            f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)}); the file is damaged"
        )
    n, d = struct.unpack("<QQ", head[18:34])
    return np.dtype(DTYPES[code]), n, d


class TokenSequences:
    """What both readers (mmap here, v1.x's TNTIDX in legacy_indexed_dataset.py) answer the
    same way: `len`, `num_documents`, `get(i, offset, length)`, `ds[i]`, `ds[a:b]`. A reader
    sets `prefix`, `sizes`, `doc_idx` and `dtype`, and reads a checked span with `_read`."""

    prefix: str
    sizes: np.ndarray
    doc_idx: np.ndarray
    dtype: np.dtype

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self.prefix}: [{offset}, {offset + length}) outside sequence {i} "
                f"of {size} tokens"
            )
        return self._read(i, offset, length)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"{self.prefix}: sequence {i} out of range ({len(self)} sequences)")
        return self.get(i)


class MMapIndexedDataset(TokenSequences):
    """Read-only view of PREFIX.bin/.idx; `ds[i]` is sequence i as a numpy array (zero-copy)."""

    def __init__(self, prefix: str | os.PathLike, warmup: bool = False):
        self.prefix = str(prefix)
        self._load()
        self.warmed_bytes = touch_pages(self._idx) + touch_pages(self._bin) if warmup else 0

    def __getstate__(self):  # DataLoader workers under spawn/forkserver re-map the files
        return {"prefix": self.prefix, "warmed_bytes": self.warmed_bytes}

    def __setstate__(self, state):
        self.prefix, self.warmed_bytes = state["prefix"], state["warmed_bytes"]
        self._load()

    def _load(self) -> None:
        prefix = self.prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        self.dtype, n, d = _read_header(idx_path)
        self.pair = open_pair(prefix)
        expected = HEADER_SIZE + 12 * n + 8 * d
        actual = os.path.getsize(idx_path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{idx_path}: {actual} bytes, but its header promises {expected} "
                f"({n} sequences, {d} document entries); the file is truncated or damaged"
            )
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(self._idx, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(self._idx, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.doc_idx = np.frombuffer(self._idx, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
        self._check_index(idx_path, n)
        self._bin = self._open_bin(bin_path, n)
        self._check_pointers(idx_path, n)

    def _check_index(self, idx_path: str, n: int) -> None:
        if len(self.doc_idx) == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n:
            raise IndexedDatasetError(
                f"{idx_path}: document index must run from 0 to {n} sequences; the file is damaged"
            )
        if n and (self.sizes.min() < 0 or np.any(np.diff(self.doc_idx) < 0)):
            raise IndexedDatasetError(f"{idx_path}: negative sizes or unordered document index")

    def _open_bin(self, bin_path: str, n: int):
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: {actual} bytes, but the index points to {expected} "
                f"(dtype {self.dtype}) in {index_file_path(self.prefix)}; the .bin is "
                "truncated or the two files do not belong together"
            )
        if actual == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(bin_path, mode="r", dtype=np.uint8)

    def _check_pointers(self, idx_path: str, n: int) -> None:
        """Sequence i+1 must start where sequence i ends: pointers[i+1] - pointers[i] ==
        sizes[i] * itemsize, and pointers[0] == 0. With the .bin size check (last pointer +
        last size) this ties every sequence to its bytes; checking only the last one let an
        index claiming extra tokens for a document train silently on its neighbours' tokens."""
        if n == 0:
            return
        itemsize = self.dtype.itemsize
        if self.pointers[0] != 0:
            raise IndexedDatasetError(
                f"{idx_path}: sequence 0 (document 0) starts at byte {int(self.pointers[0])} "
                "of the .bin, not 0; the index is damaged"
            )
        for start in range(0, n - 1, _CHECK_BLOCK):
            stop = min(start + _CHECK_BLOCK, n - 1)
            gaps = self.pointers[start + 1 : stop + 1] - self.pointers[start:stop]
            wrong = np.flatnonzero(gaps != self.sizes[start:stop].astype(np.int64) * itemsize)
            if len(wrong):
                i = start + int(wrong[0])
                doc = int(np.searchsorted(self.doc_idx, i, side="right")) - 1
                size = int(self.sizes[i])
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {i} (document {doc}) has {size} tokens "
                    f"({size * itemsize} bytes of {self.dtype}), but the next sequence starts "
                    f"{int(gaps[wrong[0]])} bytes after it; the index is damaged or belongs to "
                    "another .bin"
                )

    def _read(self, i: int, offset: int, length: int) -> np.ndarray:
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __repr__(self) -> str:
        return (
            f"MMapIndexedDataset({Path(self.prefix).name!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype})"
        )

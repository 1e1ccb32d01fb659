"""Reading tables for preprocessing: Parquet files and `datasets.save_to_disk` directories.

Both stream record batches (a few thousand rows at a time, only the --json-keys columns), so
memory stays bounded whatever the table's size. Each row becomes the same record a JSON line
would be ({column: value}), numbered from 1 within its file, so a bad row is reported as
`FILE:ROW: reason` and follows the same --bad-records policy, and the same texts give
byte-identical .bin/.idx output to the JSON lines path. pyarrow is imported only here, only
when a table is read (pip install pyarrow, or the [data] extra).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

HF_STATE, HF_DICT = "state.json", "dataset_dict.json"
_BATCH_ROWS = 4096


def is_hf_dataset_dir(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, HF_STATE)) or os.path.isfile(os.path.join(path, HF_DICT))
    )


def hf_arrow_files(directory: str) -> list[str]:
    """The data files of one saved Dataset, in order (state.json lists them)."""
    if os.path.isfile(os.path.join(directory, HF_DICT)):
        with open(os.path.join(directory, HF_DICT)) as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(
            f"--input {directory}: a DatasetDict with splits {splits}; pass one split's "
            f"directory, e.g. --input {os.path.join(directory, splits[0] if splits else 'train')}"
        )
    with open(os.path.join(directory, HF_STATE)) as f:
        files = [d["filename"] for d in json.load(f).get("_data_files", [])]
    if not files:
        raise ValueError(f"--input {directory}: {HF_STATE} lists no data files")
    return [os.path.join(directory, name) for name in files]


def table_size(path: str) -> int:
    """Bytes on disk (for the progress line's MB and ETA)."""
    files = hf_arrow_files(path) if os.path.isdir(path) else [path]
    return sum(os.path.getsize(f) for f in files)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(
            "reading Parquet or saved datasets needs pyarrow: pip install pyarrow "
            "(or pip install 'megatron-3d[data]')"
        ) from None
    return pyarrow


def _check_columns(path: str, names: list[str], columns: list[str]) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(
            f"{path}: no column {missing[0]!r} (columns: {names[:10]}); name the text column "
            f"with --json-keys"
        )


def _parquet_batches(path: str, columns: list[str]):
    """(record batch, bytes of the file read so far: its size x the fraction of rows read)."""
    pa = _pyarrow()
    table = pa.parquet.ParquetFile(path)
    _check_columns(path, table.schema_arrow.names, columns)
    size, rows, done = os.path.getsize(path), max(table.metadata.num_rows, 1), 0
    for batch in table.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
        done += batch.num_rows
        yield batch, size * done // rows


def _arrow_stream_batches(path: str, columns: list[str]):
    """One `datasets` arrow file: an Arrow IPC stream, memory-mapped, read batch by batch."""
    pa = _pyarrow()
    source = pa.memory_map(path, "r")
    reader = pa.ipc.open_stream(source)
    _check_columns(path, reader.schema.names, columns)
    for batch in reader:
        yield batch.select(columns), source.tell()


class RowPosition:
    """A file-like `tell()` for the progress line: the bytes of the rows read so far."""

    def __init__(self, done: int = 0):
        self.done = done

    def tell(self) -> int:
        return self.done


def table_rows(
    path: str, columns: list[str], chunk_bytes: int, position: RowPosition
) -> Iterator[tuple[str, list]]:
    """(file, [(row number, {column: value})]) chunks of about chunk_bytes of text."""
    if os.path.isdir(path):
        sources = [(f, _arrow_stream_batches(f, columns)) for f in hf_arrow_files(path)]
    else:
        sources = [(path, _parquet_batches(path, columns))]
    for name, batches in sources:
        items, size, row, base = [], 0, 0, position.done
        for batch, read in batches:
            for record in batch.to_pylist():
                row += 1
                items.append((row, record))
                size += sum(len(v) for v in record.values() if isinstance(v, str))
            position.done = base + read
            if size >= chunk_bytes:
                yield name, items
                items, size = [], 0
        if items:
            yield name, items

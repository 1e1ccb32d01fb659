"""Reading corpora for preprocessing: loose JSON lines, JSON arrays, plain text, any of them .gz;
Parquet files and `datasets.save_to_disk` directories (megatron/data/preprocess_tables.py).

Everything streams: the reader yields chunks of a few MB with the file and line number of each
record, so memory stays flat whatever the corpus size, and every bad record can be reported as
`FILE:LINE: reason`. Decoding and JSON parsing happen in the workers (`decode_record`).
A damaged compressed input (megatron/data/input_compression.py) is a bad record too, at the
line where reading stopped, naming the byte offset and the likely cause.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from megatron.data.input_compression import (
    DECOMPRESS_ERRORS,
    DamagedInput,
    GzipReader,
    unsuffixed_compression,
)
from megatron.data.preprocess_tables import RowPosition, is_hf_dataset_dir, table_rows, table_size

JSON_LINE, TEXT, VALUE, TABLE = "json-line", "text", "value", "table"
TEXT_WHOLE = "text-whole"  # a .txt read as one document, every newline kept
TXT_DOCUMENTS = ("line", "paragraph", "file")  # what a document of a .txt input is
_READ_SIZE = 1 << 20


@dataclass(frozen=True)
class BadRecord:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Chunk:
    path: str
    kind: str  # JSON_LINE (raw bytes), TEXT (raw bytes), VALUE (parsed JSON value or table row)
    items: list  # [(line or row number, payload)]
    bad: list  # BadRecords found while reading (e.g. a broken JSON array)
    blank_lines: int = 0  # blank lines of a one-document-per-line input, left out


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files, globs or directories -> sorted file list; a pattern matching nothing is an error.
    A `datasets.save_to_disk` directory stays one input."""
    files: list[str] = []
    for pattern in patterns:
        if is_hf_dataset_dir(pattern):
            matches = [pattern]
        elif os.path.isdir(pattern):
            matches = sorted(
                os.path.join(pattern, f)
                for f in os.listdir(pattern)
                if os.path.isfile(os.path.join(pattern, f))
            )
        else:
            matches = sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"--input {pattern}: no such file (or the glob matched none)")
        files.extend(matches)
    return files


def input_kind(path: str) -> str:
    """`.txt` is plain text; `.json` whose first non-space byte is '[' is an array; `.parquet`
    and saved datasets are tables; else lines."""
    if path.endswith(".parquet") or os.path.isdir(path):
        return TABLE
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".txt"):
        return TEXT
    if name.endswith(".json"):
        try:
            with _open(path) as f:
                head = f.read(4096).lstrip()
        except DECOMPRESS_ERRORS:
            return JSON_LINE  # read_chunks reports what is wrong with it, naming the file
        if head.startswith(b"["):
            return VALUE
    return JSON_LINE


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


class ProgressFile:
    """Counts the raw (on-disk, possibly compressed) bytes read, for MB/s and ETA."""

    def __init__(self):
        self.done_bytes = 0  # bytes of files already finished
        self._raw = None

    def track(self, raw) -> None:
        self._raw = raw

    def finish(self, size: int) -> None:
        self.done_bytes += size
        self._raw = None

    @property
    def bytes_read(self) -> int:
        try:
            current = self._raw.tell() if self._raw is not None else 0
        except (OSError, ValueError):
            current = 0
        return self.done_bytes + current


def input_size(path: str) -> int:
    return table_size(path) if input_kind(path) == TABLE else os.path.getsize(path)


def _table_chunks(path, columns, chunk_bytes, progress: ProgressFile) -> Iterator[Chunk]:
    position = RowPosition()
    progress.track(position)
    try:
        for name, items in table_rows(path, columns, chunk_bytes, position):
            yield Chunk(name, VALUE, items, [])
    finally:
        progress.finish(table_size(path))


def read_chunks(
    paths: list[str],
    chunk_bytes: int,
    progress: ProgressFile,
    txt_documents: str = "line",
    columns: list[str] | None = None,
) -> Iterator[Chunk]:
    """`txt_documents`: what a document of a .txt input is (TXT_DOCUMENTS: one per line, one
    per blank-line-separated paragraph, or the whole file as one stream); `columns`: the
    --json-keys, the only columns read from tables."""
    for path in paths:
        if input_kind(path) == TABLE:
            yield from _table_chunks(path, columns or ["text"], chunk_bytes, progress)
            continue
        raw = open(path, "rb")  # noqa: SIM115
        progress.track(raw)
        try:
            kind = input_kind(path)
            compressed = None if path.endswith(".gz") else unsuffixed_compression(path, raw)
            if compressed:
                yield Chunk(path, kind, [], [BadRecord(path, 1, compressed)])
                continue
            f = GzipReader(path, raw) if path.endswith(".gz") else raw
            if kind == VALUE:
                yield from _array_chunks(path, f, chunk_bytes)
            elif kind == TEXT and txt_documents == "file":
                try:
                    text = f.read()
                except DamagedInput as e:  # a truncated .gz: named as a bad record, as lines are
                    yield Chunk(path, TEXT_WHOLE, [], [BadRecord(path, 1, str(e))])
                    continue
                yield Chunk(path, TEXT_WHOLE, [(1, text)], [])  # tokenized in pieces
            else:
                paragraphs = kind == TEXT and txt_documents == "paragraph"
                yield from _line_chunks(path, kind, f, chunk_bytes, paragraphs)
        finally:
            raw.close()
            progress.finish(os.path.getsize(path))


def _line_chunks(path, kind, f, chunk_bytes, paragraphs) -> Iterator[Chunk]:
    items, size, blank = [], 0, 0
    para: list[bytes] = []
    para_line = line_no = 0
    lines = enumerate(f, start=1)
    while True:
        try:
            line_no, line = next(lines)
        except StopIteration:
            break
        except DamagedInput as e:  # keep what was read; the rest of the file is lost
            yield Chunk(path, kind, items, [BadRecord(path, line_no + 1, str(e))])
            return
        if paragraphs:
            if line.strip():
                para_line = para_line or line_no
                para.append(line)
                continue
            if not para:
                continue
            line, line_no, para, para_line = b"".join(para), para_line, [], 0
        elif not line.strip():
            blank += 1  # no document: counted for the summary
            continue
        items.append((line_no, line))
        size += len(line)
        if size >= chunk_bytes:
            yield Chunk(path, kind, items, [], blank)
            items, size, blank = [], 0, 0
    if para:
        items.append((para_line, b"".join(para)))
    if items or blank:
        yield Chunk(path, kind, items, [], blank)


def _array_chunks(path, f, chunk_bytes) -> Iterator[Chunk]:
    """Stream the elements of one top-level JSON array without loading the whole file."""
    items, size = [], 0
    try:
        for line_no, value, nbytes in _iter_json_array(f):
            items.append((line_no, value))
            size += nbytes
            if size >= chunk_bytes:
                yield Chunk(path, VALUE, items, [])
                items, size = [], 0
    except _ArrayError as e:
        yield Chunk(path, VALUE, items, [BadRecord(path, e.line, e.reason)])
        return
    if items:
        yield Chunk(path, VALUE, items, [])


class _ArrayError(Exception):
    def __init__(self, line, reason):
        super().__init__(reason)
        self.line, self.reason = line, reason


_WS = re.compile(r"\s*")


class _ArrayReader:
    """Incremental parser of one top-level JSON array; line numbers counted once per byte."""

    def __init__(self, f):
        self.f, self.decoder = f, json.JSONDecoder()
        self.buf, self.pos, self.eof = "", 0, False
        self.pending = b""  # an incomplete UTF-8 character at the end of the last read
        self.line, self.counted = 1, 0  # line number at buf[self.counted]

    def line_at(self, p: int) -> int:
        self.line += self.buf.count("\n", self.counted, p)
        self.counted = p
        return self.line

    def more(self) -> None:
        try:
            data = self.f.read(_READ_SIZE)
        except DamagedInput as e:
            raise _ArrayError(self.line_at(len(self.buf)), str(e)) from None
        if not data:
            self.eof = True
            if self.pending:
                raise _ArrayError(self.line_at(len(self.buf)), "not valid UTF-8 at end of file")
            return
        data, self.pending = self.pending + data, b""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":
                bad = self.line_at(len(self.buf)) + data[: e.start].count(b"\n")
                raise _ArrayError(bad, f"not valid UTF-8 (byte 0x{data[e.start]:02x})") from None
            text, self.pending = data[: e.start].decode("utf-8"), data[e.start :]
        self.line_at(self.pos)
        self.buf, self.counted, self.pos = self.buf[self.pos :] + text, 0, 0

    def skip_ws(self) -> None:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return
            self.more()

    def expect(self, char: str, what: str) -> None:
        self.skip_ws()
        if self.pos >= len(self.buf) or self.buf[self.pos] != char:
            raise _ArrayError(self.line_at(self.pos), what)
        self.pos += 1

    def __iter__(self):
        self.expect("[", "expected a JSON array starting with '['")
        first = True
        while True:
            self.skip_ws()
            if self.pos >= len(self.buf):
                raise _ArrayError(self.line_at(self.pos), "the JSON array is not closed")
            if self.buf[self.pos] == "]":
                return
            if not first:
                self.expect(",", "expected ',' between array elements")
                self.skip_ws()
            first = False
            while True:
                try:
                    value, end = self.decoder.raw_decode(self.buf, self.pos)
                    break
                except json.JSONDecodeError as e:
                    if self.eof:
                        raise _ArrayError(
                            self.line_at(self.pos), f"malformed JSON element: {e.msg}"
                        ) from None
                    self.more()
            yield self.line_at(self.pos), value, end - self.pos
            self.pos = end


def _iter_json_array(f):
    return iter(_ArrayReader(f))


def decode_record(kind: str, payload, keys: list[str]) -> tuple[dict | None, str | None]:
    """One raw record -> ({key: text}, None) or (None, reason it is bad)."""
    if kind in (JSON_LINE, TEXT, TEXT_WHOLE):
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"not valid UTF-8 (byte 0x{payload[e.start]:02x} at column {e.start + 1})"
        if kind == TEXT_WHOLE:
            return {keys[0]: text}, None
        if kind == TEXT:
            return {keys[0]: text.rstrip("\r\n")}, None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"malformed JSON: {e.msg} at column {e.colno}"
    else:
        obj = payload
    if isinstance(obj, str):  # a bare string is a document (JSON arrays of strings)
        return {keys[0]: obj}, None
    if not isinstance(obj, dict):
        return None, f"expected a JSON object or string, got {type(obj).__name__}"
    for key in keys:
        if key not in obj:
            return None, f"missing key {key!r} (keys present: {sorted(obj)[:5]})"
        if not isinstance(obj[key], str):
            return None, f"key {key!r} is a {type(obj[key]).__name__}, not a string"
    return {key: obj[key] for key in keys}, None


_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*\s+|[。！？；]+[”’」』)]*\s*|\n\s*\n")


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """A small rule-based splitter (no model download): ends at . ! ? followed by space, at
    CJK full stops, and at blank lines. Whitespace between sentences is dropped; with
    `keep_newlines` (v1.x's --keep-newlines) it stays at the end of the sentence before it, so
    the sentences concatenate back to the text (leading whitespace joins the first one)."""
    out, start, lead = [], 0, ""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]
    for end in ends:
        piece, start = text[start:end], end
        if not piece.strip():  # whitespace only: belongs to the sentence before it
            if out:
                out[-1] += piece if keep_newlines else ""
            else:
                lead += piece
            continue
        out.append(lead + piece if keep_newlines else piece.strip())
        lead = ""
    return out

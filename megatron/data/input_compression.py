"""Compressed corpora for preprocessing: `.gz` inputs are read through `GzipReader`, which turns
a damaged stream into `DamagedInput` naming the byte offset and the likely cause (a `.gz` that
is not gzip, a truncated download, corrupt data); `unsuffixed_compression` recognises a
compressed file (gzip, zstd, bzip2, xz, by their first bytes) whose name lacks `.gz`, which
would otherwise read as a flood of "not valid UTF-8" lines.
"""

from __future__ import annotations

import gzip
import os
import zlib

DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error)  # gzip.BadGzipFile is an OSError
_MAGIC = {b"\x1f\x8b": "gzip", b"(\xb5/\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}


def compression_of(head: bytes) -> str | None:
    """The compression whose magic bytes `head` starts with (None: none known)."""
    return next((name for magic, name in _MAGIC.items() if head.startswith(magic)), None)


def unsuffixed_compression(path: str, raw) -> str | None:
    """Why a file without .gz cannot be read as text: it is compressed (None: it is not).
    `raw` is the open file, left at its start."""
    head = raw.read(8)
    raw.seek(0)
    kind = compression_of(head)
    if kind is None:
        return None
    fix = f"rename it to {os.path.basename(path)}.gz" if kind == "gzip" else "decompress it first"
    return (
        f"this file is {kind}-compressed (its first bytes, at byte 0, are {head[:4].hex(' ')}) "
        f"but its name does not end in .gz; {fix}"
    )


class DamagedInput(Exception):
    """A compressed input that cannot be read on; the message names the offset and the cause."""


class GzipReader:
    """The decompressed lines and bytes of a .gz input; a damaged stream raises DamagedInput."""

    def __init__(self, path: str, raw):
        self.path, self.raw = path, raw
        self.gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self.out = 0  # decompressed bytes delivered

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.gz.read(n)
        except DECOMPRESS_ERRORS as e:
            raise self._damaged(e) from None
        self.out += len(data)
        return data

    def __iter__(self):
        while True:
            try:
                line = self.gz.readline()
            except DECOMPRESS_ERRORS as e:
                raise self._damaged(e) from None
            if not line:
                return
            self.out += len(line)
            yield line

    def _damaged(self, error: Exception) -> DamagedInput:
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
        if not head.startswith(b"\x1f\x8b"):
            kind = compression_of(head)
            if kind:
                what, fix = f"{kind}-compressed", "decompress it and gzip it, or drop the .gz"
            elif head:
                what, fix = (
                    f"not compressed (it starts with {head!r})",
                    "drop the .gz from its name",
                )
            else:
                what, fix = "empty", "recreate it"
            return DamagedInput(f"not a gzip file although named .gz: {what} at byte 0; {fix}")
        if isinstance(error, EOFError):
            return DamagedInput(
                f"truncated gzip: the compressed data stops at byte {size} (the end of the "
                f"file) before the gzip end marker, after {self.out} bytes decompressed; the "
                "file was cut short (an interrupted download or copy?): fetch it again"
            )
        return DamagedInput(
            f"corrupt gzip data near compressed byte {self.raw.tell()} of {size}, after "
            f"{self.out} bytes decompressed ({error}); fetch or recreate the file"
        )

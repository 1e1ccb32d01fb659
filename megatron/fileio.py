"""File-system steps the data tools, the checkpoints and the start-up checks share; standard
library only, so every package may import it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_writable(directory: str) -> None:
    """Create `directory` if missing and write (and remove) a file in it; raises the OSError."""
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
        pass


def os_reason(error: OSError) -> str:
    """'[Errno N] strerror' of a failed write, or the error as it reads."""
    return f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)


def disk_space(directory: str, describe: Callable[[shutil._ntuple_diskusage], str]) -> str:
    """`describe(shutil.disk_usage(directory))`, or why the free space is unknown."""
    try:
        return describe(shutil.disk_usage(directory))
    except OSError as e:
        return f"free space on {directory} unknown ({e.strerror or e})"

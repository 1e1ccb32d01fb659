"""Checks of the run's output paths before any work: a mistake found after model building and
data indexing (or, worse, at the first save an hour in) costs the user that time."""

from __future__ import annotations

import os
import tempfile

from megatron.checkpoint.storage import CheckpointError


def check_save_dir(save: str | None) -> None:
    """--save must be a directory this process can create and write (a named error, not the
    traceback of the first write). Every rank checks it: on another node it may differ."""
    if not save:
        return
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(
            f"--save {save}: is an existing file, not a directory. Fix: pass a directory "
            "(it is created if missing)"
        )
    try:
        os.makedirs(save, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save, prefix=".write-test-"):
            pass
    except OSError as e:
        raise CheckpointError(
            f"--save {save}: cannot write there ({e.strerror or e}"
            f"{': ' + e.filename if e.filename and e.filename != save else ''}). Fix: pass a "
            "writable directory, or fix its permissions / mount"
        ) from None

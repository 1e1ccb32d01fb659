"""A corpus every machine has: the Python standard library's own sources, as JSONL.

Used by the CPU demo and the preprocessing benchmark, so neither needs a download. Files are
taken in sorted path order (site-packages excluded) until `max_bytes`, one document per file.
"""

from __future__ import annotations

import json
import os
import sysconfig


def stdlib_sources(max_bytes: int):
    root = sysconfig.get_paths()["stdlib"]
    taken = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few test files are deliberately not UTF-8
            if not text.strip():
                continue
            yield os.path.relpath(path, root), text
            taken += len(text.encode("utf-8"))
            if taken >= max_bytes:
                return


def write_stdlib_corpus(path: str, max_bytes: int = 30_000_000) -> tuple[int, int]:
    """Write {"text": source, "path": relative path} lines; returns (documents, bytes)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    docs = 0
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for rel, text in stdlib_sources(max_bytes):
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
            docs += 1
    os.replace(tmp, path)
    return docs, os.path.getsize(path)
